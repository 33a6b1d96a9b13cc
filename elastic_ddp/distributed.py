"""Process-group lifecycle: read torchrun's environment, pick device and backend, form the group
with a named timeout, and tear it down on every exit path.

A rank that cannot reach its peers fails with :class:`DistributedInitError` naming the rank,
the store address and the timeout, never a silent hang. Without torchrun's environment the
runtime forms a one-rank group on an in-memory store, so the same code runs as a single process.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from elastic_ddp._torch_compat import group_abort
from elastic_ddp.config import DistConfig
from elastic_ddp.errors import DistributedInitError

if TYPE_CHECKING:
    from elastic_ddp.inprocess import LaunchedMembership

logger = logging.getLogger(__name__)

NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
KEEP_THE_PROCESS = "2"
"""``CleanUpOnly``: on a collective's error or timeout torch's NCCL watchdog aborts the communicators and the error
is raised in the training thread, which the in-process mode re-forms from; torch's default (3) ends the process."""


def keep_the_process_on_nccl_errors() -> dict[str, str]:
    """What an NCCL group of the in-process mode is formed with: ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (set here
    unless the user set it; another value is warned of once, since it ends a survivor's process and recovery
    falls back to a restart), read by torch when the group is created; the settings, for the log and the check."""
    value = os.environ.setdefault(NCCL_ERROR_HANDLING, KEEP_THE_PROCESS)
    if value != KEEP_THE_PROCESS and value not in _WARNED:
        _WARNED.add(value)
        logger.warning("%s=%s ends a process whose NCCL collective fails; the in-process mode needs %s (a lost peer "
                       "then costs every survivor a restart)", NCCL_ERROR_HANDLING, value, KEEP_THE_PROCESS)
    return {NCCL_ERROR_HANDLING: value}


_WARNED: set[str] = set()


def nccl_options() -> object:
    """Options of an NCCL group of the in-process mode: non-blocking communicators, so that creating one and
    aborting one whose peer is gone return instead of waiting inside NCCL (torch polls them)."""
    options = dist.ProcessGroupNCCL.Options()
    options.config.blocking = 0
    return options


@dataclass(frozen=True)
class LaunchEnv:
    """What the launcher (torchrun's agent) told this process, or the single-process defaults."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str
    master_port: int
    run_id: str
    restart_count: int
    group_rank: int
    under_launcher: bool

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> LaunchEnv:
        env = os.environ if env is None else env
        if "RANK" not in env:
            return cls(0, 0, 1, 1, "127.0.0.1", 0, env.get("TORCHELASTIC_RUN_ID", "local"), 0, 0, False)
        try:
            return cls(
                rank=int(env["RANK"]),
                local_rank=int(env.get("LOCAL_RANK", "0")),
                world_size=int(env["WORLD_SIZE"]),
                local_world_size=int(env.get("LOCAL_WORLD_SIZE", "1")),
                master_addr=env["MASTER_ADDR"],
                master_port=int(env["MASTER_PORT"]),
                run_id=env.get("TORCHELASTIC_RUN_ID", "local"),
                restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
                group_rank=int(env.get("GROUP_RANK", "0")),
                under_launcher=True,
            )
        except KeyError as exc:
            raise DistributedInitError(f"RANK is set but {exc.args[0]} is not: launch with torchrun") from exc
        except ValueError as exc:
            raise DistributedInitError(f"malformed launcher environment: {exc}") from exc


def select_device(config: DistConfig, local_rank: int) -> torch.device:
    """cuda:LOCAL_RANK when asked for or available (auto), else cpu."""
    want_cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    if not want_cuda:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise DistributedInitError("--dist-device cuda was asked for but CUDA is not available")
    if local_rank >= torch.cuda.device_count():
        raise DistributedInitError(
            f"local rank {local_rank} has no GPU: only {torch.cuda.device_count()} visible; "
            "lower --nproc-per-node"
        )
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def select_backend(config: DistConfig, device: torch.device) -> str:
    """nccl for CUDA devices, gloo for CPU, unless the config names one."""
    if config.backend != "auto":
        if config.backend == "nccl" and device.type != "cuda":
            raise DistributedInitError("--dist-backend nccl needs a CUDA device")
        return config.backend
    return "nccl" if device.type == "cuda" else "gloo"


@dataclass(frozen=True)
class DistContext:
    """The formed process group as the rest of the runtime sees it."""

    env: LaunchEnv
    device: torch.device
    backend: str
    membership: LaunchedMembership | None = None
    """Under the etcd-v3 handler's in-process mode: the worker membership this process joined (give it to the
    runtime); None otherwise."""

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def is_main(self) -> bool:
        return self.env.rank == 0


def cpu_group(world_size: int, timeout_s: float, own: bool) -> dist.ProcessGroup | None:
    """A gloo group of all ranks, for collectives that must stay on the CPU (object collectives, flags
    read every step). None: one process, or, unless ``own`` is asked for, the default group when it is
    gloo already. A background thread's collectives need ``own``: on the group the training step uses
    they would interleave with its all-reduces."""
    if world_size == 1 or (not own and dist.get_backend() == "gloo"):
        return None
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    # every rank is a member of a group of all ranks; torch types the non-member's answer in too
    assert isinstance(group, dist.ProcessGroup), group
    return group


STORE_PROBE_INTERVAL_S = 0.005
"""How often a rank polls for rank 0's store to listen before it connects (see :func:`_open_store`)."""
STORE_PROBE_ENV = "ELASTIC_DDP_STORE_PROBE"
"""``0`` turns that wait off (torch's client backoff alone): the comparison in ``benchmarks/rendezvous.py``."""


def _open_store(env: LaunchEnv, timeout: timedelta) -> dist.Store:
    """The workers' store, connected within ``timeout``.

    Rank 0's worker hosts a fresh store each attempt (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``),
    and the other ranks usually start before it listens. torch's client then backs off 500 ms
    (±50 %, growing) between refused attempts, so a server that comes up a little late costs up to
    a second; a rank first waits, polling every few ms, until the port accepts, and then connects
    at once (``benchmarks/pg_init.py`` measures both)."""
    if not env.under_launcher:
        return dist.HashStore()
    if env.rank != 0 and os.environ.get(STORE_PROBE_ENV, "1") != "0":
        wait_until_listening(env.master_addr, env.master_port, time.monotonic() + timeout.total_seconds())
    try:
        store, _, _ = next(dist.rendezvous("env://", env.rank, env.world_size, timeout=timeout))
    except (RuntimeError, ValueError, OSError) as exc:
        raise DistributedInitError(
            f"rank {env.rank}: cannot reach the store at {env.master_addr}:{env.master_port} "
            f"within --dist-init-timeout-s={timeout.total_seconds():g}: {_first_line(exc)}"
        ) from exc
    if shares_agent_store() and one_agent(env):
        return dist.PrefixStore(f"elastic_ddp/attempt-{env.restart_count}/", store)
    return store


def one_agent(env: LaunchEnv) -> bool:
    """Whether every worker of this attempt is this agent's (``torchrun --standalone``, one node). In torchrun's
    long-lived agent store, each attempt's keys are then kept apart under the agent's restart count, which all
    its workers share and which grows with every restart of a single agent (elastic_ddp/rendezvous/RESTARTS.md;
    across agents the counts differ, so a job of several nodes needs a fresh store from its launcher)."""
    return env.world_size == env.local_world_size


def wait_until_listening(host: str, port: int, deadline: float, interval: float = STORE_PROBE_INTERVAL_S) -> bool:
    """Poll ``host:port`` until a TCP connection succeeds (True) or ``deadline`` (a ``time.monotonic()``
    value) passes (False); the probe connection is closed at once, without a byte sent."""
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.001, min(1.0, deadline - time.monotonic()))):
                return True
        except OSError:
            if time.monotonic() + interval >= deadline:
                return False
            time.sleep(interval)


def _first_line(exc: BaseException) -> str:
    """torch's store errors carry a C++ stack trace after the first line; the first line is the message."""
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def init_distributed(config: DistConfig, env: LaunchEnv | None = None) -> DistContext:
    """Form the default process group from the launcher's environment (or a one-rank group)."""
    env = env or LaunchEnv.from_env()
    device = select_device(config, env.local_rank)
    backend = select_backend(config, device)
    init_timeout = timedelta(seconds=config.init_timeout_s)
    store = _open_store(env, init_timeout)
    store.set_timeout(init_timeout)
    try:
        dist.init_process_group(
            backend=backend,
            store=store,
            rank=env.rank,
            world_size=env.world_size,
            timeout=timedelta(seconds=config.collective_timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
    except (RuntimeError, ValueError, OSError) as exc:
        raise DistributedInitError(
            f"rank {env.rank}/{env.world_size}: could not form the {backend} process group through "
            f"{env.master_addr}:{env.master_port} within --dist-init-timeout-s={config.init_timeout_s:g}: {_first_line(exc)}"
        ) from exc
    logger.info(
        "process group formed: rank %d/%d backend=%s device=%s store=%s:%d",
        env.rank, env.world_size, backend, device, env.master_addr, env.master_port,
    )
    if env.rank == 0 and shares_agent_store() and not one_agent(env):
        logger.warning(
            "the workers of %d nodes share torchrun's long-lived agent store (MASTER_PORT=%d, restart %d): keys left "
            "by a failed attempt can break the next restart. Launch torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
            "(elastic_ddp's launch scripts do; the etcd-v3 rendezvous never shares it) to give every attempt a fresh store",
            env.world_size // max(env.local_world_size, 1), env.master_port, env.restart_count,
        )
    return DistContext(env=env, device=device, backend=backend)


def shares_agent_store() -> bool:
    """Whether this attempt's workers use torchrun's long-lived agent store (keys of failed attempts stay in it)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def shutdown_distributed() -> None:
    """Destroy the default process group if one exists; safe to call on any exit path."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


ABANDON_TIMEOUT_S = 5.0
"""How long :func:`abandon_group` waits for torch to let go of a broken group before it gives up on it."""


def abandon_group(timeout_s: float = ABANDON_TIMEOUT_S) -> str:
    """Give up the default process group after a peer is lost: abort it where torch has
    ``ProcessGroup.abort``, then destroy it, so that a new group can be formed in this process; where torch
    has no abort, destroy it as :func:`shutdown_distributed` does.

    Runs on a thread of its own and waits at most ``timeout_s`` (a collective of the broken group may hold
    it). Returns what was done: ``"abort"``, ``"destroy"``, ``"none"`` (no group), or ``"stuck"`` (torch did
    not return in time; the caller ends the process anyway)."""
    if not (dist.is_available() and dist.is_initialized()):
        return "none"
    abort = group_abort(dist.group.WORLD)  # type: ignore[arg-type]
    done = threading.Event()

    def let_go() -> None:
        if abort is not None:
            abort()
        dist.destroy_process_group()
        done.set()

    started = time.monotonic()
    threading.Thread(target=let_go, name="elastic-ddp-abandon-group", daemon=True).start()
    if not done.wait(timeout_s):
        logger.warning("the broken process group was not let go within %.1f s", timeout_s)
        return "stuck"
    how = "abort" if abort is not None else "destroy"
    logger.info("abandoned the broken process group (%s) in %.3f s", how, time.monotonic() - started)
    return how


@dataclass(frozen=True)
class Reformed:
    """What :func:`reform_group` did, and how long each half took."""

    abandoned: str
    """How the old group was let go (:func:`abandon_group`'s answer)."""
    abandon_s: float
    form_s: float
    """Forming the new group, up to and including its first collective (every member took part)."""


def reform_group(store: dist.Store, *, rank: int, world_size: int, generation: int, backend: str,
                 device: torch.device, timeout_s: float) -> Reformed:
    """Give up the default process group (:func:`abandon_group`) and form the next membership's in this process
    (:func:`form_membership_group`), keeping everything else the process holds (the interpreter, the CUDA
    context, the model and optimizer on their device)."""
    started = time.perf_counter()
    abandoned = abandon_group()
    abandon_s = time.perf_counter() - started
    return Reformed(abandoned=abandoned, abandon_s=abandon_s,
                    form_s=form_membership_group(store, rank=rank, world_size=world_size, generation=generation,
                                                 backend=backend, device=device, timeout_s=timeout_s, abandoned=abandoned))


def form_membership_group(store: dist.Store, *, rank: int, world_size: int, generation: int, backend: str,
                          device: torch.device, timeout_s: float, abandoned: str) -> float:
    """Form the default process group of membership ``generation``, once the one before was let go
    (``abandoned``: :func:`abandon_group`'s answer); the seconds it took, up to and including a first barrier.

    ``rank`` and ``world_size`` are this process's place in the new membership, agreed beforehand; every member
    calls this with the same ``generation``, whose keys in ``store`` (under ``elastic_ddp/membership-<n>/``) no
    earlier group used. Raises :class:`DistributedInitError` when the old group was not let go, or the members
    do not meet within ``timeout_s``."""
    if abandoned == "stuck":
        raise DistributedInitError(f"rank {rank}: the broken process group was not let go; a new one cannot be formed")
    started = time.perf_counter()
    prefixed = dist.PrefixStore(f"elastic_ddp/membership-{generation}/", store)
    options = None
    if backend == "nccl":
        keep_the_process_on_nccl_errors()
        options = nccl_options()
    try:
        dist.init_process_group(backend=backend, store=prefixed, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s), device_id=device if device.type == "cuda" else None,
                                pg_options=options)
        dist.barrier(device_ids=[device.index]) if device.type == "cuda" else dist.barrier()
    except (RuntimeError, ValueError, OSError) as exc:
        raise DistributedInitError(f"rank {rank}/{world_size}: could not form the {backend} group of membership "
                                   f"{generation} within {timeout_s:g} s: {_first_line(exc)}") from exc
    return time.perf_counter() - started


def step_spread(step: int, group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """The lowest and highest of every member's ``step`` (one MAX all-reduce of two integers on ``group``, a
    group on the CPU): after a re-formation, whether the members ended the old membership on one step."""
    both = torch.tensor([step, -step], dtype=torch.int64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    return -int(both[1]), int(both[0])


@contextmanager
def distributed(config: DistConfig, env: LaunchEnv | None = None) -> Iterator[DistContext]:
    """Form the process group for the duration of a ``with`` block and always tear it down."""
    context = init_distributed(config, env)
    try:
        yield context
    finally:
        shutdown_distributed()

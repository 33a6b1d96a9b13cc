"""The fault catalogue: what each fault does to a running job, and when it fires.

Every fault acts from the outside, as the real failure would: signals to worker or node
processes, an etcd member stopped, the storage endpoint cut off or slowed, bytes flipped in a
committed checkpoint. A :class:`Fault` couples a :class:`~chaos.scenario.FaultSpec` with a
:class:`TriggerState` (a pure state machine over what the runner observed) and an action
``fire(env)`` that returns what it did (:class:`FaultRecord`) and what to undo later
(:class:`FollowUp`, e.g. SIGCONT after a hang, etcd back after an outage).

One fault needs the job's cooperation: ``crash-worker`` raises an exception inside a worker,
which no signal can do. It uses the example's ``ELASTIC_DDP_FAULT=crash:RANK:STEP`` hook
(``examples/faults.py``): the runner starts the first nodes with that variable, and the
fault fires in the job's first launch, at step ``at_step`` counted from that launch's start.
Another script would need the same hook.
"""

from __future__ import annotations

import http.server
import json
import logging
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from chaos.cluster import HOST, LocalCluster, Node, host_name
from chaos.etcd import EtcdCluster, EtcdServer
from chaos.netns import Fabric, Host, call_in
from chaos.s3 import StorageProxy
from chaos.scenario import ChaosError, FaultSpec, Target, Trigger

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
SPOT_PATH = "/latest/meta-data/spot/instance-action"
SPOT_POLL_INTERVAL_S = 0.5


class FaultError(ChaosError):
    """A fault could not be carried out (not a target being gone: that is a skipped fault)."""


# -- triggers (pure) -------------------------------------------------------------------


@dataclass(frozen=True)
class Previous:
    """When the previous fault of the schedule fired: seconds since the start, and the newest step then."""

    elapsed_s: float = 0.0
    step: int = 0


START = Previous()
"""What the first fault of a schedule counts from."""


@dataclass(frozen=True)
class Observation:
    """What the runner saw at one tick of its loop."""

    elapsed_s: float
    """Seconds since the first node started."""
    step: int
    """The newest step the job logged (0 before the first)."""
    world_size: int = 0
    """The world size of the newest step logged (0 before the first)."""
    unfinished_saves: frozenset[int] = frozenset()
    """Steps whose ``step-*`` directory exists without a manifest."""


class TriggerState:
    """Decides, tick by tick, whether a trigger's conditions hold; no I/O.

    ``at_s``, ``at_step``, ``after_s``, ``after_steps`` and ``world_size`` must all hold (those given); the
    ``after_*`` ones count from the previous fault's firing (:class:`Previous`). A ``during_save`` trigger then arms:
    it remembers the unfinished saves it sees at that moment and fires on the first step
    directory without a manifest that was not among them — a save that started after arming.
    """

    def __init__(self, trigger: Trigger) -> None:
        self.trigger = trigger
        self.armed_with: frozenset[int] | None = None
        self.save_step: int | None = None
        """The step whose save was in flight when a during_save trigger fired."""

    def update(self, observation: Observation, previous: Previous | None = START) -> bool:
        """True once, at the first observation where the trigger's conditions hold.

        ``previous``: when the previous fault of the schedule fired; None if it has not yet.
        """
        if not self._conditions_hold(observation, previous):
            return False
        if not self.trigger.during_save:
            return True
        if self.armed_with is None:
            self.armed_with = observation.unfinished_saves
            return False
        new = observation.unfinished_saves - self.armed_with
        if not new:
            return False
        self.save_step = min(new)
        return True

    def _conditions_hold(self, observation: Observation, previous: Previous | None) -> bool:
        trigger = self.trigger
        if trigger.at_s is not None and observation.elapsed_s < trigger.at_s:
            return False
        if trigger.at_step is not None and observation.step < trigger.at_step:
            return False
        if trigger.world_size is not None and observation.world_size != trigger.world_size:
            return False
        if trigger.after_s is None and trigger.after_steps is None:
            return True
        if previous is None:
            return False
        if trigger.after_s is not None and observation.elapsed_s - previous.elapsed_s < trigger.after_s:
            return False
        return trigger.after_steps is None or observation.step - previous.step >= trigger.after_steps


# -- targets (pure) --------------------------------------------------------------------


@dataclass(frozen=True)
class Choice:
    """A chosen target index, or why there is none."""

    index: int | None
    reason: str = ""


def choose_node(target: Target, running: list[int], rng: random.Random, min_nodes: int) -> Choice:
    """The node a fault hits, among the indices of running nodes (in start order).

    ``node:N`` hits node N if it runs. ``random`` and ``newest`` pick automatically and never take
    the job below ``min_nodes`` (a scenario that means to lose the job names the node).
    """
    if target.form == "node":
        if target.index in running:
            return Choice(target.index)
        return Choice(None, f"node{target.index} is not running")
    if len(running) <= min_nodes:
        return Choice(None, f"only {len(running)} node(s) running and the job needs {min_nodes}")
    if target.form == "newest":
        return Choice(running[-1])
    return Choice(rng.choice(running))


def choose_worker(target: Target, ranks: dict[int, int], rng: random.Random) -> Choice:
    """The worker pid a fault hits: by global rank, or random; ``ranks`` maps rank to pid."""
    if not ranks:
        return Choice(None, "no worker is running")
    if target.form == "rank":
        pid = ranks.get(target.index)
        return Choice(pid) if pid is not None else Choice(None, f"no running worker has rank {target.index}")
    return Choice(ranks[rng.choice(sorted(ranks))])


# -- what a fault did --------------------------------------------------------------------


@dataclass
class FaultRecord:
    """One fault as it happened (or why it did not)."""

    index: int
    kind: str
    label: str
    fired_at: float | None = None
    """Wall-clock time (``time.time()``) the fault landed; None if it never fired."""
    target: str = ""
    detail: str = ""
    skipped: str = ""
    """Why it did not fire (its target was gone, the job finished first...)."""
    ended_at: float | None = None
    """When a fault with a duration was undone (SIGCONT, etcd back, storage back)."""
    removes: tuple[str, ...] = ()
    """Nodes this fault takes out of the job (their exit status is not the job's)."""

    @property
    def fired(self) -> bool:
        return self.fired_at is not None


@dataclass(frozen=True)
class FollowUp:
    """Something to do ``delay_s`` after a fault fired (undo it, or enforce a grace period)."""

    delay_s: float
    action: Callable[[], str]
    """Does it and returns a line for the record, or "" when there was nothing left to do."""
    ends_fault: bool = False
    """Marks the end of the fault's duration (the record's ``ended_at``)."""


@dataclass
class Fired:
    """What firing a fault did, and what is left to do later."""

    record: FaultRecord
    follow_ups: list[FollowUp] = field(default_factory=list)


# -- the environment faults act on --------------------------------------------------------


@dataclass
class ChaosEnv:
    """Everything a fault may touch; built and owned by the runner."""

    cluster: LocalCluster
    rng: random.Random
    min_nodes: int
    add_node: Callable[[], Node]
    store: CheckpointStore
    etcd: EtcdServer | EtcdCluster | None = None
    proxy: StorageProxy | None = None
    spot: SpotServer | None = None
    fabric: Fabric | None = None
    """The namespaces and bridge the hosts run on (cluster.network = 'namespaces'); the network faults act on it."""
    departing: set[str] = field(default_factory=set)
    """Nodes a fault took out of the job (they may still be saving and exiting)."""
    frozen: set[str] = field(default_factory=set)
    """Nodes currently stopped with SIGSTOP."""

    def running_indices(self) -> list[int]:
        """Indices of nodes that run and are not leaving (in start order)."""
        return [index for index, node in enumerate(self.cluster.nodes)
                if node.running and node.name not in self.departing]

    def worker_ranks(self) -> dict[int, int]:
        """Global rank -> pid of every worker of every running, not leaving node."""
        ranks: dict[int, int] = {}
        for index in self.running_indices():
            for pid in self.cluster.nodes[index].worker_pids():
                rank = worker_rank(pid)
                if rank is not None:
                    ranks[rank] = pid
        return ranks


def worker_rank(pid: int) -> int | None:
    """The global rank torchrun gave a worker (its ``RANK``), read from /proc; None if it is gone."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as handle:
            environ = handle.read().split(b"\0")
    except OSError:
        return None
    for entry in environ:
        if entry.startswith(b"RANK="):
            return int(entry[5:])
    return None


# -- the faults ---------------------------------------------------------------------------


class Fault:
    """A scheduled fault: its spec, its trigger's state, and the action of its kind."""

    kind: ClassVar[str] = ""
    removes_node: ClassVar[bool] = False
    """Whether the node it hits leaves the job (so its exit status is not the job's)."""

    def __init__(self, spec: FaultSpec, index: int) -> None:
        self.spec = spec
        self.index = index
        self.trigger = TriggerState(spec.trigger)
        self.record = FaultRecord(index=index, kind=spec.kind, label=spec.label)
        self.fired: Previous | None = None
        """When the runner fired it (also set when it was skipped): what the next fault's ``after_*`` count from."""

    def due(self, observation: Observation, previous: Previous | None = START) -> bool:
        """Whether to fire now; ``previous``: when the previous fault of the schedule fired, None if not yet."""
        return self.fired is None and self.trigger.update(observation, previous)

    def fire(self, env: ChaosEnv) -> Fired:
        """Carry the fault out (or record why not); stamps the record with the time it landed."""
        follow_ups = self.act(env)
        if not self.record.skipped:
            self.record.fired_at = self.record.fired_at or time.time()
        logger.info("fault %s: %s %s%s", self.record.label, self.record.target or "-", self.record.detail,
                    f" (skipped: {self.record.skipped})" if self.record.skipped else "")
        return Fired(self.record, follow_ups)

    def act(self, env: ChaosEnv) -> list[FollowUp]:
        raise NotImplementedError

    def skip(self, reason: str) -> list[FollowUp]:
        self.record.skipped = reason
        return []

    # helpers for node-level faults

    def pick_node(self, env: ChaosEnv) -> Node | None:
        choice = choose_node(self.spec.target, env.running_indices(), env.rng, env.min_nodes)
        if choice.index is None:
            self.skip(choice.reason)
            return None
        node = env.cluster.nodes[choice.index]
        self.record.target = node.name
        if self.removes_node:
            env.departing.add(node.name)
            self.record.removes = (node.name,)
        return node

    def pick_worker(self, env: ChaosEnv) -> int | None:
        ranks = env.worker_ranks()
        choice = choose_worker(self.spec.target, ranks, env.rng)
        if choice.index is None:
            self.skip(choice.reason)
            return None
        rank = next(rank for rank, pid in ranks.items() if pid == choice.index)
        self.record.target = f"rank {rank} (pid {choice.index})"
        return choice.index


class KillWorker(Fault):
    """SIGKILL one worker process: the agent sees it die and restarts the whole group."""

    kind = "kill-worker"

    def act(self, env: ChaosEnv) -> list[FollowUp]:
        pid = self.pick_worker(env)
        if pid is not None:
            _signal_pid(pid, signal.SIGKILL)
            self.record.detail = "SIGKILL"
        return []


class CrashWorker(Fault):
    """An exception in one worker, raised by the job itself through ``ELASTIC_DDP_FAULT`` (see the module
    docstring). Firing only records it; the runner stamps the time of the worker's own log line."""

    kind = "crash-worker"

    def env(self) -> dict[str, str]:
        return {"ELASTIC_DDP_FAULT": f"crash:{self.spec.target.index}:{self.spec.trigger.at_step}"}

    def due(self, observation: Observation, previous: Previous | None = START) -> bool:
        step = self.spec.trigger.at_step or 0
        return self.fired is None and observation.step >= step - 1

    def act(self, env: ChaosEnv) -> list[FollowUp]:
        self.record.target = f"rank {self.spec.target.index}"
        self.record.detail = f"raises in step {self.spec.trigger.at_step} of the first launch (ELASTIC_DDP_FAULT)"
        return []


class KillNode(Fault):
    """SIGKILL the agent and every worker of a node: the machine is gone."""

    kind = "kill-node"
    removes_node = True

    def act(self, env: ChaosEnv) -> list[FollowUp]:
        node = self.pick_node(env)
        if node is not None:
            node.signal_node(signal.SIGKILL)
            node.lose_memory()
            self.record.detail = "SIGKILL to agent and workers; its memory (replicas) is gone"
        return []


class KillDuringSave(KillNode):
    """SIGKILL a node while a checkpoint save is in flight (a new step directory has no manifest yet)."""

    kind = "kill-during-save"

    def act(self, env: ChaosEnv) -> list[FollowUp]:
        step = self.trigger.save_step
        node = self.pick_node(env)
        if node is None or step is None:
            return []
        node.signal_node(signal.SIGKILL)
        node.lose_memory()
        interrupted = not env.store.has_manifest(step)
        self.record.detail = (f"SIGKILL during the save of step {step}: "
                              + ("no manifest yet at the kill" if interrupted else "the manifest landed first"))
        return []


class PreemptNode(Fault):
    """SIGTERM to the node's agent (an orchestrator's preemption); SIGKILL if it still runs after the grace."""

    kind = "preempt-node"
    removes_node = True
    how = "SIGTERM to the agent"

    def act(self, env: ChaosEnv) -> list[FollowUp]:
        node = self.pick_node(env)
        if node is None:
            return []
        self.notify(env, node)
        self.record.detail = f"{self.how}, SIGKILL after {self.spec.grace_s:.0f} s"
        return [FollowUp(self.spec.grace_s, lambda: _kill_if_running(node))]

    def notify(self, env: ChaosEnv, node: Node) -> None:
        node.signal_agent(signal.SIGTERM)


class RemoveNode(PreemptNode):
    """Scale down: the same graceful SIGTERM to the agent, by default to the newest node."""

    kind = "remove-node"
    how = "graceful removal (SIGTERM to the agent)"


class SpotNotice(PreemptNode):
    """A spot interruption notice on the node's metadata endpoint; the workers poll it, save and leave."""

    kind = "spot-notice"
    how = "spot interruption notice"

    def notify(self, env: ChaosEnv, node: Node) -> None:
        if env.spot is None:
            raise FaultError("spot-notice needs the runner's metadata server")
        env.spot.notify(node.name)


class HangWorker(Fault):
    """SIGSTOP one worker; SIGCONT after ``duration_s`` (if given)."""

    kind = "hang-worker"

    def act(self, env: ChaosEnv) -> list[FollowUp]:
        pid = self.pick_worker(env)
        if pid is None:
            return []
        _signal_pid(pid, signal.SIGSTOP)
        self.record.detail = "SIGSTOP" + (f", SIGCONT after {self.spec.duration_s:.0f} s" if self.spec.duration_s else "")
        if not self.spec.duration_s:
            return []
        return [FollowUp(self.spec.duration_s, lambda: "SIGCONT" if _signal_pid(pid, signal.SIGCONT) else "", True)]


class HangNode(Fault):
    """SIGSTOP a whole node (agent and workers); SIGCONT after ``duration_s`` (if given)."""

    kind = "hang-node"

    def act(self, env: ChaosEnv) -> list[FollowUp]:
        node = self.pick_node(env)
        if node is None:
            return []
        node.signal_node(signal.SIGSTOP)
        env.frozen.add(node.name)
        self.record.detail = "SIGSTOP" + (f", SIGCONT after {self.spec.duration_s:.0f} s" if self.spec.duration_s else "")
        if not self.spec.duration_s:
            return []

        def resume() -> str:
            env.frozen.discard(node.name)
            node.signal_node(signal.SIGCONT)
            return "SIGCONT"

        return [FollowUp(self.spec.duration_s, resume, True)]


class AddNode(Fault):
    """Start one more node; it joins at the next rendezvous round."""

    kind = "add-node"

    def act(self, env: ChaosEnv) -> list[FollowUp]:
        node = env.add_node()
        self.record.target = node.name
        self.record.detail = f"started (agent pid {node.pid})"
        return []


class RestartEtcd(Fault):
    """Stop etcd (every member) for ``duration_s``, then start it on the same ports and data."""

    kind = "restart-etcd"

    def act(self, env: ChaosEnv) -> list[FollowUp]:
        etcd = env.etcd
        if etcd is None:
            raise FaultError("restart-etcd needs the runner's etcd")
        etcd.stop()
        self.record.target = "etcd"
        self.record.detail = f"stopped for {self.spec.duration_s:.0f} s"

        def start() -> str:
            etcd.start()
            return "started again"

        return [FollowUp(self.spec.duration_s, start, True)]


class KillEtcdLeader(Fault):
    """SIGKILL the leader of the 3-member etcd cluster; restart it after ``duration_s`` (if given)."""

    kind = "kill-etcd-leader"

    def act(self, env: ChaosEnv) -> list[FollowUp]:
        if not isinstance(env.etcd, EtcdCluster):
            raise FaultError("kill-etcd-leader needs a 3-member etcd cluster")
        leader = env.etcd.leader()
        leader.kill()
        self.record.target = f"etcd {leader.spec.name}"
        self.record.detail = "SIGKILL to the leader"
        if not self.spec.duration_s:
            return []

        def restart() -> str:
            leader.start()
            return f"etcd {leader.spec.name} started again"

        return [FollowUp(self.spec.duration_s, restart, True)]


class StorageOutage(Fault):
    """Cut the job off from the S3 endpoint for ``duration_s`` (every connection reset); objects stay."""

    kind = "storage-outage"

    def act(self, env: ChaosEnv) -> list[FollowUp]:
        proxy = _proxy(env, self.kind)
        proxy.set_down(True)
        self.record.target = "s3"
        self.record.detail = f"down for {self.spec.duration_s:.0f} s"

        def up_again() -> str:
            proxy.set_down(False)
            return "up again"

        return [FollowUp(self.spec.duration_s, up_again, True)]


class SlowStorage(Fault):
    """Add ``delay_s`` to every chunk sent to the S3 endpoint, for ``duration_s``."""

    kind = "slow-storage"

    def act(self, env: ChaosEnv) -> list[FollowUp]:
        proxy = _proxy(env, self.kind)
        proxy.set_delay(self.spec.delay_s)
        self.record.target = "s3"
        self.record.detail = f"+{self.spec.delay_s:.2f} s per chunk for {self.spec.duration_s:.0f} s"

        def normal_speed() -> str:
            proxy.set_delay(0.0)
            return "normal speed"

        return [FollowUp(self.spec.duration_s, normal_speed, True)]


class CorruptCheckpoint(Fault):
    """Flip a byte in (or truncate) a data file of the newest committed checkpoint."""

    kind = "corrupt-checkpoint"

    def act(self, env: ChaosEnv) -> list[FollowUp]:
        damaged = env.store.corrupt_newest(self.spec.mode)
        if damaged is None:
            return self.skip("no committed checkpoint yet")
        self.record.target = damaged
        self.record.detail = "flipped one byte" if self.spec.mode == "flip" else "truncated to half its size"
        return []


# -- network faults (cluster.network = 'namespaces') ------------------------------------------


def peer_hosts(peers: str, target: str, hosts: list[str]) -> list[str]:
    """The fabric hosts on the other side of a network fault aimed at host ``target`` (pure).

    ``hosts``: every fabric host by name (``n<i>`` nodes, ``e<i>`` etcd members, ``s3`` the storage
    endpoint); ``peers``: ``nodes``, ``etcd``, ``storage``, ``all`` or ``node:N``.
    """
    groups = {"nodes": "n", "etcd": "e", "storage": "s3"}
    if peers.startswith("node:"):
        chosen = ["n" + peers.removeprefix("node:")]
    elif peers == "all":
        chosen = [name for name in hosts if name[0] in "nes"]
    else:
        prefix = groups[peers]
        chosen = [name for name in hosts if name.startswith(prefix) and (prefix != "n" or name[1:].isdigit())]
    return [name for name in chosen if name in hosts and name != target]


def directed_pairs(target: str, peers: list[str], direction: str) -> list[tuple[list[str], list[str]]]:
    """(sources, destinations) whose packets a fault drops: ``out`` is what the target sends, ``in`` what it
    receives, ``both`` both (pure)."""
    out, into = ([target], peers), (peers, [target])
    return {"out": [out], "in": [into], "both": [out, into]}[direction]


class NetworkFault(Fault):
    """A fault on one node's links, acting on the bridge (:mod:`chaos.netns`)."""

    def fabric(self, env: ChaosEnv) -> Fabric:
        if env.fabric is None:
            raise FaultError(f"{self.kind} needs cluster.network = 'namespaces'")
        return env.fabric

    def links(self, env: ChaosEnv) -> tuple[str, list[tuple[list[str], list[str]]]] | None:
        """The target host and the (sources, destinations) the fault hits; None when skipped."""
        fabric = self.fabric(env)
        node = self.pick_node(env)
        if node is None:
            return None
        target = host_name(node.name)
        peers = peer_hosts(self.spec.peers, target, list(fabric.hosts))
        if not peers:
            self.skip(f"no host matches peers = {self.spec.peers!r}")
            return None
        return target, directed_pairs(target, peers, self.spec.direction)

    def describe(self, what: str) -> None:
        arrow = {"both": "<->", "out": "->", "in": "<-"}[self.spec.direction]
        self.record.detail = f"{what} {arrow} {self.spec.peers}" + (
            f" for {self.spec.duration_s:.0f} s" if self.spec.duration_s else "")


class Partition(NetworkFault):
    """Drop every packet between a node and its peers (silently, on the bridge); undone after ``duration_s``
    (if given) or by a ``heal`` fault, and by the kernel after :data:`chaos.netns.PARTITION_TTL_S` anyway."""

    kind = "partition"

    def act(self, env: ChaosEnv) -> list[FollowUp]:
        links = self.links(env)
        if links is None:
            return []
        fabric = self.fabric(env)
        _, pairs = links
        for sources, destinations in pairs:
            fabric.partition(sources, destinations)
        self.describe("partition")
        if not self.spec.duration_s:
            return []

        def heal() -> str:
            for sources, destinations in pairs:
                fabric.unpartition(sources, destinations)
            return "healed"

        return [FollowUp(self.spec.duration_s, heal, True)]


class PacketLoss(NetworkFault):
    """Drop ``percent`` % of the packets between a node and its peers at random; the loss rules are removed
    after ``duration_s`` (if given) or by a ``heal`` fault."""

    kind = "packet-loss"

    def act(self, env: ChaosEnv) -> list[FollowUp]:
        links = self.links(env)
        if links is None:
            return []
        fabric = self.fabric(env)
        for sources, destinations in links[1]:
            fabric.packet_loss(sources, destinations, self.spec.percent)
        self.describe(f"{self.spec.percent:g} % loss")
        if not self.spec.duration_s:
            return []

        def end() -> str:
            fabric.no_loss()
            return "loss removed"

        return [FollowUp(self.spec.duration_s, end, True)]


class Latency(NetworkFault):
    """Delay every packet between a node and its peers by ``delay_ms`` ± ``jitter_ms`` (one way, on the receiving
    host: an NFQUEUE delay line, :mod:`chaos.delayline`); removed after ``duration_s`` (if given) or by ``heal``."""

    kind = "latency"

    def act(self, env: ChaosEnv) -> list[FollowUp]:
        links = self.links(env)
        if links is None:
            return []
        fabric = self.fabric(env)
        receivers = []
        for sources, destinations in links[1]:
            for receiver in destinations:
                fabric.latency(receiver, sources, self.spec.delay_ms, self.spec.jitter_ms)
                receivers.append(receiver)
        jitter = f" ± {self.spec.jitter_ms:g}" if self.spec.jitter_ms else ""
        self.describe(f"+{self.spec.delay_ms:g}{jitter} ms")
        if not self.spec.duration_s:
            return []

        def end() -> str:
            for receiver in receivers:
                fabric.no_latency(receiver)
            return "latency removed"

        return [FollowUp(self.spec.duration_s, end, True)]


class Bandwidth(NetworkFault):
    """Limit a node's link to ``rate_mbit`` each way (tbf); lifted after ``duration_s`` (if given) or by ``heal``."""

    kind = "bandwidth"

    def act(self, env: ChaosEnv) -> list[FollowUp]:
        fabric = self.fabric(env)
        node = self.pick_node(env)
        if node is None:
            return []
        host = host_name(node.name)
        fabric.bandwidth(host, self.spec.rate_mbit)
        self.record.detail = f"{self.spec.rate_mbit:g} Mbit/s each way" + (
            f" for {self.spec.duration_s:.0f} s" if self.spec.duration_s else "")
        if not self.spec.duration_s:
            return []

        def end() -> str:
            fabric.unlimited(host)
            return "rate limit lifted"

        return [FollowUp(self.spec.duration_s, end, True)]


class Heal(NetworkFault):
    """Undo every partition, loss rule, delay and rate limit."""

    kind = "heal"

    def act(self, env: ChaosEnv) -> list[FollowUp]:
        fabric = self.fabric(env)
        fabric.heal()
        for name in fabric.hosts:
            fabric.unlimited(name)
        for name in list(fabric.delay_lines):
            fabric.no_latency(name)
        self.record.target = "network"
        self.record.detail = "every partition, loss rule, delay and rate limit removed"
        return []


FAULT_CLASSES: dict[str, type[Fault]] = {
    cls.kind: cls
    for cls in (KillWorker, CrashWorker, KillNode, KillDuringSave, PreemptNode, RemoveNode, SpotNotice, HangWorker,
                HangNode, AddNode, RestartEtcd, KillEtcdLeader, StorageOutage, SlowStorage, CorruptCheckpoint,
                Partition, PacketLoss, Latency, Bandwidth, Heal)
}


def make_faults(specs: tuple[FaultSpec, ...]) -> list[Fault]:
    """One :class:`Fault` per scheduled spec, in schedule order."""
    return [FAULT_CLASSES[spec.kind](spec, index) for index, spec in enumerate(specs)]


def _proxy(env: ChaosEnv, kind: str) -> StorageProxy:
    if env.proxy is None:
        raise FaultError(f"{kind} needs cluster.checkpoint = 's3' (the storage proxy)")
    return env.proxy


def _signal_pid(pid: int, signum: int) -> bool:
    """Signal one process; False if it is already gone."""
    try:
        os.kill(pid, signum)
        return True
    except ProcessLookupError:
        return False


def _kill_if_running(node: Node) -> str:
    if not node.running:
        return ""
    node.signal_node(signal.SIGKILL)
    node.lose_memory()
    return f"{node.name} still running after the grace period: SIGKILL"


# -- the checkpoint store as chaos sees it ---------------------------------------------------


def in_flight(without_manifest: set[int], committed: set[int]) -> frozenset[int]:
    """Steps whose save is in flight: no manifest yet, and newer than every committed step."""
    newest = max(committed, default=-1)
    return frozenset(step for step in without_manifest if step > newest)


@dataclass(frozen=True)
class Commit:
    """A committed checkpoint the runner saw: its step, data digest and world size, and when."""

    step: int
    data_digest: str
    world_size: int
    seen_at: float


class CheckpointStore:
    """The job's checkpoint root, read (and damaged) directly, never through a fault proxy."""

    def __init__(self, uri: str, options: dict[str, Any] | None = None) -> None:
        import fsspec  # the runtime's own dependency; imported when a run starts

        self.uri = uri.rstrip("/")
        self.fs, self.root = fsspec.core.url_to_fs(self.uri, **(options or {}))
        self.committed: dict[int, str] = {}
        """Step -> manifest token of the checkpoints seen committed (and still committed)."""
        self.commits: list[Commit] = []
        """Every commit seen, in order (a step committed again after an un-commit appears twice)."""

    def path(self, step: int, name: str = "") -> str:
        base = f"{self.root}/step-{step:08d}"
        return f"{base}/{name}" if name else base

    def steps(self) -> list[int]:
        """Steps that have a ``step-*`` directory, ascending."""
        if not self.fs.exists(self.root):
            return []
        self.fs.invalidate_cache()
        names = (entry.rstrip("/").rsplit("/", 1)[-1] for entry in self.fs.ls(self.root, detail=False))
        return sorted(int(name[5:]) for name in names if name.startswith("step-") and name[5:].isdigit())

    def has_manifest(self, step: int) -> bool:
        return bool(self.fs.exists(self.path(step, MANIFEST)))

    def scan(self) -> frozenset[int]:
        """Look at the root once: record new commits; return the saves in flight, i.e. the steps without a
        manifest newer than every committed one (an older directory without one is being removed by retention,
        or is the leftover of a failed save)."""
        missing = set()
        for step in self.steps():
            if step in self.committed and self.has_manifest(step):
                continue  # known; a manifest is never rewritten, only removed (un-committed) and created anew
            manifest = self._read_manifest(step)
            if manifest is None:
                self.committed.pop(step, None)
                missing.add(step)
            else:
                self.committed[step] = manifest["token"]
                digest = manifest.get("meta", manifest).get("data_digest")  # format 2 keeps it in meta, format 1 on top
                self.commits.append(Commit(step, digest, manifest["world_size"], time.time()))
        return in_flight(missing, set(self.committed))

    def _read_manifest(self, step: int) -> dict[str, Any] | None:
        try:
            with self.fs.open(self.path(step, MANIFEST), "rb") as handle:
                return json.loads(handle.read())
        except (FileNotFoundError, ValueError):  # not committed, or the manifest is being renamed into place
            return None

    def corrupt_newest(self, mode: str) -> str | None:
        """Damage the largest data file of the newest committed checkpoint; its path, or None if none."""
        committed = [step for step in self.steps() if self.has_manifest(step)]
        if not committed:
            return None
        directory = self.path(committed[-1])
        files = [entry for entry in self.fs.ls(directory, detail=True) if not entry["name"].endswith(".json")]
        victim = max(files, key=lambda entry: entry["size"])["name"]
        with self.fs.open(victim, "rb") as handle:
            data = bytearray(handle.read())
        if mode == "flip":
            data[len(data) // 2] ^= 0xFF
        else:
            del data[len(data) // 2:]
        with self.fs.open(victim, "wb") as handle:
            handle.write(bytes(data))
        return f"{self.uri}/{victim.rsplit('/', 2)[-2]}/{victim.rsplit('/', 1)[-1]}"


# -- spot interruption notices -----------------------------------------------------------------


class SpotServer:
    """Instance metadata on 127.0.0.1: ``/<node>/latest/meta-data/spot/instance-action`` answers 404
    until :meth:`notify` issues a notice for that node, then 200 with the action (as AWS does)."""

    def __init__(self, host: Host | None = None) -> None:
        self.noticed: set[str] = set()
        handler = _spot_handler(self.noticed)
        self.host = HOST if host is None else host.address
        """127.0.0.1, or a fabric host's address (the listening socket is made in its namespace)."""
        if host is None:
            self.server = http.server.ThreadingHTTPServer((HOST, 0), handler)
        else:
            self.server = call_in(host.namespace, lambda: http.server.ThreadingHTTPServer((host.address, 80), handler))
        self.thread = threading.Thread(target=self.server.serve_forever, name="spot-metadata", daemon=True)

    def start(self) -> SpotServer:
        self.thread.start()
        return self

    def url(self, node_name: str) -> str:
        return f"http://{self.host}:{self.server.server_address[1]}/{node_name}{SPOT_PATH}"

    def node_args(self, node_name: str) -> list[str]:
        """The job flags that make a node poll its own notice."""
        return ["--resilience-spot-notice-url", self.url(node_name),
                "--resilience-spot-poll-interval-s", str(SPOT_POLL_INTERVAL_S)]

    def notify(self, node_name: str) -> None:
        self.noticed.add(node_name)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _spot_handler(noticed: set[str]) -> type[http.server.BaseHTTPRequestHandler]:
    class SpotMetadata(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            node = self.path.split("/")[1] if self.path.count("/") > 1 else ""
            if node in noticed and self.path == f"/{node}{SPOT_PATH}":
                body = b'{"action": "terminate", "time": "2026-11-30T12:00:00Z"}'
                self.send_response(200)
            else:
                body = b"Not Found"
                self.send_response(404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    return SpotMetadata

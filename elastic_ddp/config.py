"""Training configuration: one frozen dataclass per component, nested in :class:`TrainConfig`.

The command line is generated from these dataclasses: every field is a flag whose
help text is the field's docstring. A field of a section is spelled
``--<section>-<field>`` (``checkpoint.every`` is ``--checkpoint-every``); a
top-level field is ``--<field>`` (``--max-steps``). A TOML or JSON file given with
``--config`` is layered under the flags, with one table per section.

The runtime owns only its own sections (loader, optim, ddp, checkpoint, dist, resilience, log).
A training script adds its own by subclassing :class:`TrainConfig`::

    @dataclass(frozen=True, kw_only=True)
    class ModelConfig:
        '''My model's shape.'''
        width: int = 128
        '''Hidden width.'''                     # the flag's help text
        def problems(self) -> Problems: ...     # optional: (field, what is wrong) pairs

    @dataclass(frozen=True, kw_only=True)
    class MyConfig(TrainConfig):
        model: ModelConfig = field(default_factory=ModelConfig)   # --model-width
        use_amp: bool = True                                       # a runtime default, overridden

    config = config_from_args(config_class=MyConfig)

Every field a script adds is part of the resume fingerprint (a checkpoint made with another
value is refused, naming the flag) unless it is declared with :func:`not_fingerprinted`.

Validation happens once, up front, in :meth:`TrainConfig.__post_init__`: every
problem of every section, the script's included, is collected and reported together, each
naming its flag.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import hashlib
import importlib.util
import inspect
import json
import math
import operator
import os
import sys
import typing
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from elastic_ddp.errors import ConfigError

Problems = list[tuple[str, str]]
"""(field name, what is wrong) pairs collected by a section's ``problems()``."""

MAX_SECONDS = 1_000_000.0
"""Upper bound of every duration setting (about 11.6 days): larger values are typos, and some
(1e300) would overflow the timedelta a process group or a thread wait is given."""


def _seconds_problem(value: float, *, zero_ok: bool, zero_means: str = "") -> str | None:
    """What is wrong with a duration in seconds, or None."""
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
        return f"must be a finite number of seconds {'>= 0' if zero_ok else '> 0'}{f' ({zero_means})' if zero_means else ''}"
    if value > MAX_SECONDS:
        return f"must be at most {MAX_SECONDS:g} seconds"
    return None


@dataclass(frozen=True, kw_only=True)
class LoaderConfig:
    """How the runtime orders and loads the script's dataset (the global cursor's sampler)."""

    shuffle: bool = True
    """Draw each epoch's order as a permutation of (seed, epoch); off: natural order."""
    drop_last: bool = True
    """Drop the tail of an epoch smaller than a global batch; off: the last step of an epoch is smaller."""
    num_workers: int = 0
    """DataLoader worker processes per rank (0 loads in the training process)."""
    prefetch_factor: int = 2
    """Micro-batches each DataLoader worker loads ahead (only with num_workers > 0)."""

    def problems(self) -> Problems:
        found: Problems = []
        if self.num_workers < 0:
            found.append(("num_workers", "must be >= 0"))
        if self.prefetch_factor < 1:
            found.append(("prefetch_factor", "must be >= 1"))
        return found


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """The runtime's default AdamW and learning-rate schedule (a script's own optimizer factory may read them too)."""

    lr: float = 3e-3
    """Peak learning rate."""
    weight_decay: float = 0.01
    """AdamW decoupled weight decay."""
    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float = 0.999
    """AdamW second-moment decay."""
    eps: float = 1e-8
    """AdamW denominator epsilon."""
    schedule: Literal["constant", "cosine", "linear"] = "cosine"
    """Shape of the learning rate after warmup."""
    warmup_steps: int = 0
    """Steps of linear warmup from 0 to the peak learning rate."""
    decay_steps: int = 0
    """Step at which the decay reaches its floor; 0 means --max-steps. Set it explicitly when a
    run is split into several launches with different --max-steps, so the schedule is the same."""
    min_lr_ratio: float = 0.1
    """Floor of the decay as a fraction of the peak learning rate."""
    grad_clip_norm: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    zero: bool = False
    """Shard the AdamW state across ranks (ZeroRedundancyOptimizer); each rank checkpoints its shard,
    and such a checkpoint resumes only at the same world size."""

    def problems(self) -> Problems:
        found: Problems = []
        if not (self.lr > 0 and math.isfinite(self.lr)):
            found.append(("lr", "must be a finite number > 0"))
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            found.append(("weight_decay", "must be a finite number >= 0"))
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                found.append((name, "must be in [0, 1)"))
        if self.eps <= 0:
            found.append(("eps", "must be > 0"))
        if self.warmup_steps < 0:
            found.append(("warmup_steps", "must be >= 0"))
        if self.decay_steps < 0:
            found.append(("decay_steps", "must be >= 0 (0 means --max-steps)"))
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            found.append(("min_lr_ratio", "must be in [0, 1]"))
        if self.grad_clip_norm < 0:
            found.append(("grad_clip_norm", "must be >= 0 (0 disables clipping)"))
        return found


@dataclass(frozen=True, kw_only=True)
class DdpConfig:
    """How the trainer wraps the model in DistributedDataParallel (the library path builds its own)."""

    find_unused_parameters: bool = False
    """Let the forward leave some parameters unused (a head used only for evaluation, a branch taken on some
    steps, experts that get no tokens). Off is faster: DDP then expects every parameter's gradient each step,
    and the trainer ends the run at the first step, naming the parameters that got none."""
    static_graph: bool = False
    """The set of used parameters and the order of their gradients are the same every step: DDP may then
    skip its per-step searches and reorder buckets; a model whose graph changes fails with it."""
    broadcast_buffers: bool = True
    """Copy rank 0's buffers (BatchNorm statistics) to every rank at each forward, so every rank and the
    checkpoint hold the same; a model without buffers pays nothing for it. Off: they are copied once, when
    the model is wrapped, and then each rank's evolve on their own."""
    gradient_as_bucket_view: bool = True
    """Gradients are views into DDP's all-reduce buckets: one copy fewer per step, and less memory."""
    bucket_cap_mb: float = 25.0
    """Size of each all-reduce bucket in MiB: larger buckets mean fewer collectives, smaller ones start
    communicating sooner in the backward pass."""

    def problems(self) -> Problems:
        found: Problems = []
        if not (math.isfinite(self.bucket_cap_mb) and 0 < self.bucket_cap_mb <= 4096):
            found.append(("bucket_cap_mb", "must be a number of MiB in (0, 4096]"))
        return found


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Where and how often checkpoints are committed, and how a run resumes."""

    dir: str = ""
    """Checkpoint root: a local path or an fsspec URI (file://, s3://). Empty: no checkpoints."""
    every: int = 0
    """Commit a checkpoint every N steps; 0: only by time and at the end."""
    every_seconds: float = 0.0
    """Also commit when this many seconds passed since the last commit (agreed by all ranks); 0: off."""
    keep: int = 3
    """Committed checkpoints to keep (newest first); at least 2 so a corrupt newest one has a fallback."""
    resume: bool = True
    """Resume from the newest valid checkpoint under --checkpoint-dir when there is one. Off: start at
    step 0, and refuse a --checkpoint-dir that already holds committed checkpoints."""
    allow_fresh_start: bool = False
    """When checkpoints exist but none verifies, start from step 0 instead of stopping with an error
    (the damaged ones are un-committed first, kept as manifest.rejected.json)."""
    save_final: bool = True
    """Commit a checkpoint when the run reaches --max-steps or --max-epochs."""
    async_save: bool = True
    """Save in the background: the step only copies state into reused CPU buffers; writing, hashing and
    the commit run while training continues (at most one save in flight; errors surface at the next step)."""
    replica_every: int = 1
    """Keep a replica of the state in each node's memory every N steps (at most; see
    --checkpoint-replica-budget). Every node holds the whole state; a restart resumes from the newest
    replica that survived when it is newer than the newest commit, so a killed worker or node redoes fewer
    than N steps; the survivors of a peer's loss also keep their live state there when they can (a rescue:
    at most the interrupted step is redone). 0: off, rescues too. Needs --checkpoint-dir (the fallback)."""
    replica_budget: float = 0.03
    """The share of training time replicas may take. Each costs the node's first worker a copy of the state
    into node memory and a digest; when that is more than this share of the steps between two replicas, all
    ranks agree to keep them less often (a multiple of --checkpoint-replica-every). 0: no limit."""
    replica_dir: str = ""
    """Where each node keeps its replicas; empty: $ELASTIC_DDP_REPLICA_DIR, else /dev/shm/elastic_ddp-replicas-<uid>.
    Must be node-local (each node writes its own copy): never a shared file system."""
    storage_options: str = ""
    """JSON object of fsspec options for a remote --checkpoint-dir, e.g. {"endpoint_url": "http://127.0.0.1:9000"}.
    Credentials are better left to the standard AWS environment; values here are never logged."""

    def problems(self) -> Problems:
        found: Problems = []
        if self.storage_options:
            try:
                options = json.loads(self.storage_options)
            except ValueError:
                options = None
            if not isinstance(options, dict):
                found.append(("storage_options", "must be a JSON object"))
        if self.every < 0:
            found.append(("every", "must be >= 0"))
        if self.replica_every < 0:
            found.append(("replica_every", "must be >= 0 (0: no replicas)"))
        if not 0.0 <= self.replica_budget < 1.0:
            found.append(("replica_budget", "must be in [0, 1) (0: no limit)"))
        if (what := _seconds_problem(self.every_seconds, zero_ok=True, zero_means="0: off")) is not None:
            found.append(("every_seconds", what))
        if not self.dir:
            found += [(name, "needs --checkpoint-dir (no checkpoints are written without one)")
                      for name in ("every", "every_seconds") if getattr(self, name)]
        if self.keep < 2:
            found.append(("keep", "must be >= 2 so that a corrupt newest checkpoint has a fallback"))
        return found


@dataclass(frozen=True, kw_only=True)
class DistConfig:
    """Process group, device and the timeouts that turn a lost peer into an error."""

    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Collective backend; auto: nccl when CUDA is available, else gloo."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Compute device; auto: cuda:LOCAL_RANK when CUDA is available, else cpu."""
    init_timeout_s: float = 300.0
    """Seconds to wait for every peer while forming the process group. On expiry the rank fails
    with an error naming itself, the store address and this timeout. Raise it when nodes start
    slowly; lower it to detect a missing peer sooner."""
    collective_timeout_s: float = 600.0
    """Seconds one collective may wait for its peers before failing (a dead or stuck peer
    becomes an error and torchrun restarts the group). Must exceed the slowest step."""

    def problems(self) -> Problems:
        found: Problems = []
        for name in ("init_timeout_s", "collective_timeout_s"):
            if (what := _seconds_problem(getattr(self, name), zero_ok=False)) is not None:
                found.append((name, what))
        return found


@dataclass(frozen=True, kw_only=True)
class ResilienceConfig:
    """Stop requests, emergency saves, the hang watchdog and consistency checks."""

    handle_signals: bool = True
    """Turn SIGTERM/SIGINT into a stop request: all ranks finish the step, save, and exit (torchrun
    forwards its SIGTERM to the workers and kills them after its --shutdown-timeout, 30 s by default)."""
    spot_notice_url: str = ""
    """Poll this instance-metadata URL for a spot interruption notice; 'aws' and 'gcp' name the
    clouds' standard endpoints. Empty: no polling."""
    spot_poll_interval_s: float = 5.0
    """Seconds between two polls of --resilience-spot-notice-url."""
    save_deadline_s: float = 20.0
    """An emergency save must commit within this many seconds, else the worker exits anyway and the
    previous checkpoint stays the newest. Keep it below torchrun's --shutdown-timeout."""
    watchdog_timeout_s: float = 45.0
    """A step phase (data, compute, collective, eval) that makes no progress for this long is a hang:
    stacks are dumped and the worker exits so torchrun restarts the group. 0 disables the watchdog.
    This is also the bound on a silently lost peer (a partition sends no reset, and a gloo collective would
    wait for --dist-collective-timeout-s): the survivors' workers exit after it and the agents re-form
    without the lost node. Raise it above the slowest step (the first one included)."""
    watchdog_checkpoint_timeout_s: float = 900.0
    """Like --resilience-watchdog-timeout-s, for staging or writing a regular checkpoint."""
    agreement_interval_s: float = 0.25
    """All ranks agree on stop requests and time-based saves at the end of every step, or of every
    few steps when steps are shorter than this: a request is acted on up to this much later (plus
    two steps); each agreement is one small all-reduce on the CPU. 0: every step."""
    consistency_every: int = 0
    """Every N steps all ranks compare a digest of their parameters; a mismatch stops the run naming
    the ranks that disagree. 0: off."""

    def problems(self) -> Problems:
        found: Problems = []
        durations = {
            "spot_poll_interval_s": _seconds_problem(self.spot_poll_interval_s, zero_ok=False),
            "save_deadline_s": _seconds_problem(self.save_deadline_s, zero_ok=False),
            "agreement_interval_s": _seconds_problem(self.agreement_interval_s, zero_ok=True, zero_means="0: every step"),
            "watchdog_timeout_s": _seconds_problem(self.watchdog_timeout_s, zero_ok=True, zero_means="0 disables"),
            "watchdog_checkpoint_timeout_s": _seconds_problem(self.watchdog_checkpoint_timeout_s, zero_ok=True,
                                                              zero_means="0 disables"),
        }
        found += [(name, what) for name, what in durations.items() if what is not None]
        if self.consistency_every < 0:
            found.append(("consistency_every", "must be >= 0"))
        url = self.spot_notice_url
        if url and url not in ("aws", "gcp") and not url.startswith(("http://", "https://")):
            found.append(("spot_notice_url", "must be 'aws', 'gcp' or an http(s) URL"))
        return found


@dataclass(frozen=True, kw_only=True)
class LogConfig:
    """Logs, progress and metrics."""

    every: int = 10
    """Log loss and throughput every N steps (rank 0)."""
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Log level of the runtime's loggers."""
    dir: str = ""
    """Local directory for metrics.jsonl and per-rank log files. Empty: no files, stderr only."""
    per_rank_files: bool = False
    """Also write every rank's log to <log-dir>/rank-<N>.log."""
    progress: Literal["auto", "on", "off"] = "auto"
    """Rank-0 progress bar on stderr; auto: only when stderr is a terminal."""
    tensorboard: bool = False
    """Rank 0 also writes metrics.jsonl's scalars, and a marker at each resume and fresh start, as TensorBoard
    events under <log-dir>/tensorboard. Needs --log-dir and the tensorboard package (pip install 'elastic-ddp[tensorboard]')."""
    sample_ledger: bool = False
    """Rank 0 appends one line per committed step to <log-dir>/samples.jsonl: the step, its epoch and positions
    in the epoch's permutation, the world size and the step's global sample ids, so a verifier can show that no
    sample was trained on twice or skipped across restarts. Needs --log-dir. Training is unchanged."""

    def problems(self) -> Problems:
        found: Problems = []
        if self.every < 1:
            found.append(("every", "must be >= 1"))
        if self.per_rank_files and not self.dir:
            found.append(("per_rank_files", "needs --log-dir"))
        if self.tensorboard and not self.dir:
            found.append(("tensorboard", "needs --log-dir"))
        if self.sample_ledger and not self.dir:
            found.append(("sample_ledger", "needs --log-dir"))
        if self.tensorboard and importlib.util.find_spec("tensorboard") is None:
            found.append(("tensorboard", "the tensorboard package is not installed: pip install 'elastic-ddp[tensorboard]'"))
        if self.dir and os.path.exists(self.dir) and not os.path.isdir(self.dir):
            found.append(("dir", f"{self.dir} exists and is not a directory"))
        return found


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything one training run needs. Sections are nested; top-level fields drive the loop."""

    run_id: str = ""
    """Name of the run, shown in every log line; empty: torchrun's --rdzv-id, else 'local'."""
    seed: int = 0
    """Seed of the model init, the epoch permutations and the RNG streams."""
    max_steps: int = 100
    """Stop after this many optimizer steps (counted over all launches of the run); 0: no limit."""
    max_epochs: int = 0
    """Stop at the end of this many epochs; 0: no limit. At least one of max_steps/max_epochs."""
    global_batch_size: int = 64
    """Samples per optimizer step over all ranks; unchanged when the world size changes."""
    grad_accum_steps: int = 1
    """Micro-batches each rank splits its share of a step into (gradient accumulation)."""
    use_amp: bool = False
    """Run forward and loss under torch.autocast."""
    amp_dtype: Literal["bfloat16", "float16"] = "bfloat16"
    """Autocast dtype; float16 also enables a gradient scaler."""
    eval_every: int = 0
    """Run the script's evaluation every N steps; 0: only at the end."""
    gc_every: int = 50
    """Run Python's garbage collector every N steps, on all ranks at the same step, instead of
    automatically (an automatic collection pauses one rank at a time and the others wait for it at
    the next all-reduce). 0: leave Python's automatic collection on."""
    compile: bool = False
    """Compile the model's forward and backward with torch.compile (the first steps are slower while it
    compiles). Checkpoints keep the uncompiled module's keys, so compiled and uncompiled runs resume each other."""
    compile_mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = "default"
    """torch.compile's mode (with --compile)."""

    loader: LoaderConfig = field(default_factory=LoaderConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    ddp: DdpConfig = field(default_factory=DdpConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    resilience: ResilienceConfig = field(default_factory=ResilienceConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def __post_init__(self) -> None:
        messages = [f"{flag_name(section, name)}: {what}" for section, name, what in self._all_problems()]
        if messages:
            raise ConfigError("invalid configuration:\n  " + "\n  ".join(messages))

    def _all_problems(self) -> Iterator[tuple[str, str, str]]:
        for section in section_names(type(self)):
            problems = getattr(getattr(self, section), "problems", None)
            for name, what in problems() if problems is not None else ():
                yield section, name, what
        for name, what in self.problems():
            yield "", name, what

    def problems(self) -> Problems:
        """Problems of the top-level fields and across sections; a script's subclass may extend it."""
        found: Problems = []
        if self.max_steps < 0:
            found.append(("max_steps", "must be >= 0 (0: no limit)"))
        if self.max_epochs < 0:
            found.append(("max_epochs", "must be >= 0 (0: no limit)"))
        if self.max_steps == 0 and self.max_epochs == 0:
            found.append(("max_steps", "set --max-steps or --max-epochs (both are 0: the run would never end)"))
        if self.global_batch_size < 1:
            found.append(("global_batch_size", "must be >= 1"))
        if self.grad_accum_steps < 1:
            found.append(("grad_accum_steps", "must be >= 1"))
        if self.eval_every < 0:
            found.append(("eval_every", "must be >= 0"))
        if self.gc_every < 0:
            found.append(("gc_every", "must be >= 0 (0: automatic collection)"))
        if self.compile_mode != "default" and not self.compile:
            found.append(("compile_mode", "needs --compile"))
        if self.optim.schedule != "constant" and self.optim.decay_steps == 0 and self.max_steps == 0:
            found.append(("optim_decay_steps", "a decaying --optim-schedule needs --optim-decay-steps or --max-steps"))
        return found

    @property
    def decay_steps(self) -> int:
        """The step at which the learning-rate decay reaches its floor (the schedule's horizon)."""
        return self.optim.decay_steps or self.max_steps


RUNTIME_FINGERPRINT_FIELDS: tuple[str, ...] = (
    "seed",
    "global_batch_size",
    "loader.shuffle",
    "loader.drop_last",
    "optim.zero",  # sharded optimizer state and replicated state are saved differently
)
"""The runtime's fields that define what a checkpoint *is*; resuming with any of them changed is
refused. Its other fields (max_steps, cadences, timeouts, logging, num_workers, ...) may change on
resume. Every field a script adds is fingerprinted too, unless declared with :func:`not_fingerprinted`."""

BUILD_PREFIX = "build."
"""Fingerprint entries a script's build adds (values that are not config fields, e.g. a corpus hash)."""


def not_fingerprinted(default: Any) -> Any:
    """Declare a field of a script's own section that may change when a run resumes (e.g. a
    logging cadence): ``every: int = not_fingerprinted(10)``. Leave every field that changes the
    model or the data fingerprinted."""
    return field(default=default, metadata={"fingerprint": False})


def fingerprint(config: TrainConfig) -> dict[str, Any]:
    """The config values a checkpoint must agree with to be resumed by this run."""
    return {
        dotted: operator.attrgetter(dotted)(config)
        for section, f, _ in _all_leaves(type(config))
        if _fingerprinted(dotted := _dotted(section, f.name), section, f)
    }


def _fingerprinted(dotted: str, section: str, f: dataclasses.Field) -> bool:
    if dotted in RUNTIME_FINGERPRINT_FIELDS:
        return True
    runtime_owned = section in _RUNTIME_SECTIONS if section else f.name in _RUNTIME_TOP_LEVEL
    return not runtime_owned and f.metadata.get("fingerprint", True)


def storage_options(config: CheckpointConfig) -> dict[str, Any]:
    """The parsed --checkpoint-storage-options (validated as a JSON object up front)."""
    return json.loads(config.storage_options) if config.storage_options else {}


def fingerprint_mismatches(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """Describe every fingerprint entry whose saved value differs from the current one."""
    return [
        f"{_describe_entry(name)} was {saved[name]!r} in the checkpoint, is {current[name]!r} now"
        if name in saved
        else f"{_describe_entry(name)} is not recorded in the checkpoint (saved by another script or an earlier "
        f"version), is {current[name]!r} now"
        for name in current
        if name not in saved or saved[name] != current[name]
    ]


def _describe_entry(name: str) -> str:
    if name.startswith(BUILD_PREFIX):
        return f"the training script's {name[len(BUILD_PREFIX):]}"
    return flag_for_dotted(name)


def config_digest(config: TrainConfig) -> str:
    """A short stable hash of the whole config, for logs and run directories."""
    text = json.dumps(dataclasses.asdict(config), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _dotted(section: str, name: str) -> str:
    return f"{section}.{name}" if section else name


# --------------------------------------------------------------------------- CLI


def section_names(config_class: type = TrainConfig) -> tuple[str, ...]:
    """Names of the nested sections of a config class, in declaration order."""
    hints = typing.get_type_hints(config_class)
    return tuple(f.name for f in dataclasses.fields(config_class) if _is_section(hints[f.name]))


def _is_section(hint: Any) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


_RUNTIME_SECTIONS = frozenset(section_names(TrainConfig))
_RUNTIME_TOP_LEVEL = frozenset(f.name for f in dataclasses.fields(TrainConfig)) - _RUNTIME_SECTIONS


def flag_name(section: str, name: str) -> str:
    """The command-line flag of a field: ``--<section>-<field>`` or ``--<field>`` at top level."""
    stem = f"{section}_{name}" if section else name
    return "--" + stem.replace("_", "-")


def flag_for_dotted(dotted: str) -> str:
    section, _, name = dotted.rpartition(".")
    return flag_name(section, name)


def _field_docs(cls: type) -> dict[str, str]:
    """Docstrings written under each field (the attribute-docstring convention), base classes first."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            docs.update(_own_field_docs(klass))
    return docs


@functools.cache
def _own_field_docs(cls: type) -> dict[str, str]:
    """Read from the class's source (parsing it costs CPU time): once per process,
    and a prefork server reads them before it forks, so a warm worker does not."""
    try:
        tree = ast.parse(inspect.getsource(cls))
    except (OSError, TypeError, SyntaxError):  # no source (a class made at run time): flags without help
        return {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, following in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def _leaf_fields(cls: type) -> Iterator[tuple[dataclasses.Field, Any]]:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not _is_section(hints[f.name]):
            yield f, hints[f.name]


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    factory: Any = f.default_factory
    return factory()


def _section_defaults(config_class: type) -> dict[str, Any]:
    """Each section's default instance, as the config class builds it (a script may change defaults)."""
    return {f.name: _default_of(f) for f in dataclasses.fields(config_class) if f.name in section_names(config_class)}


def build_parser(
    prog: str | None = None, description: str | None = None, config_class: type[TrainConfig] = TrainConfig
) -> argparse.ArgumentParser:
    """An argparse parser with one flag per config field, plus ``--config FILE``."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument("--config", metavar="FILE", help="TOML or JSON file layered under the flags")
    top = {f.name: _default_of(f) for f, _ in _leaf_fields(config_class)}
    _add_section_flags(parser.add_argument_group("training"), config_class, "", top)
    for section, default in _section_defaults(config_class).items():
        cls = type(default)
        values = {f.name: getattr(default, f.name) for f, _ in _leaf_fields(cls)}
        _add_section_flags(parser.add_argument_group(section, (cls.__doc__ or "").strip()), cls, section, values)
    return parser


_METAVARS = {int: "N", float: "X", str: "TEXT"}


def _add_section_flags(group: argparse._ArgumentGroup, cls: type, section: str, defaults: Mapping[str, Any]) -> None:
    docs = _field_docs(cls)
    for f, hint in _leaf_fields(cls):
        flag = flag_name(section, f.name)
        dest = _dotted(section, f.name)
        help_text = f"{docs.get(f.name, '')} (default: {defaults[f.name]!r})".replace("%", "%%")
        if hint is bool:
            group.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, help=help_text)
        elif typing.get_origin(hint) is Literal:
            group.add_argument(flag, dest=dest, choices=typing.get_args(hint), help=help_text)
        elif hint in _METAVARS:
            group.add_argument(flag, dest=dest, type=str, metavar=_METAVARS[hint], help=help_text)
        else:
            raise TypeError(f"{cls.__name__}.{f.name}: config fields are bool, int, float, str or a Literal, not {hint!r}")


C = typing.TypeVar("C", bound=TrainConfig)


def config_from_args(
    argv: Sequence[str] | None = None, prog: str | None = None, config_class: type[C] = TrainConfig  # type: ignore[assignment]
) -> C:
    """Parse flags (over an optional config file over the defaults) into a validated config.

    ``config_class`` is :class:`TrainConfig` or a script's subclass with its own sections.
    Invalid values exit with status 2 and one line per problem, each naming its flag.
    """
    parser = build_parser(prog=prog, config_class=config_class)
    namespace = vars(parser.parse_args(argv))
    try:
        values: dict[str, Any] = {}
        config_file = namespace.pop("config", None)
        if config_file:
            values.update(_flatten(load_config_file(config_file)))
        values.update(namespace)
        return make_config(values, config_class)
    except ConfigError as exc:
        from elastic_ddp.resilience.exits import ExitReason, tell_the_agent  # imports events: only on this path

        tell_the_agent(ExitReason.CONFIG, str(exc))
        parser.exit(2, f"{parser.prog}: error: {exc}\n")


def load_config_file(path: str) -> dict[str, Any]:
    """Read a TOML (``.toml``) or JSON file into nested dicts."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read()
    except OSError as exc:
        raise ConfigError(f"--config: cannot read {path}: {exc.strerror}") from exc
    try:
        if path.endswith(".toml"):
            if sys.version_info >= (3, 11):
                import tomllib
            else:  # pragma: no cover - Python 3.10
                import tomli as tomllib
            tree = tomllib.loads(raw.decode())
        else:
            tree = json.loads(raw)
    except ValueError as exc:
        raise ConfigError(f"--config: {path} is not valid {'TOML' if path.endswith('.toml') else 'JSON'}: {exc}") from exc
    if not isinstance(tree, dict):
        raise ConfigError(f"--config: {path} must hold an object of settings (one table per section), not {type(tree).__name__}")
    return tree


def _flatten(tree: Mapping[str, Any]) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            for sub, leaf in value.items():
                flat[f"{key}.{sub}"] = leaf
        else:
            flat[key] = value
    return flat


def make_config(values: Mapping[str, Any], config_class: type[C] = TrainConfig) -> C:  # type: ignore[assignment]
    """Build a config from flat ``section.field`` keys; values may be strings (from the CLI).

    Unknown keys and unconvertible values are reported together with the range checks.
    """
    known = {_dotted(section, f.name): (section, f, hint) for section, f, hint in _all_leaves(config_class)}
    defaults = _section_defaults(config_class)
    problems: list[str] = []
    converted: dict[str, dict[str, Any]] = {section: {} for section in defaults}
    top: dict[str, Any] = {}
    for key, raw in values.items():
        if key not in known:
            problems.append(f"{key}: unknown setting")
            continue
        section, f, hint = known[key]
        try:
            value = _convert(raw, hint)
        except ValueError as exc:
            problems.append(f"{flag_name(section, f.name)}: {exc}")
            continue
        (converted[section] if section else top)[f.name] = value
    sections = {name: dataclasses.replace(default, **converted[name]) for name, default in defaults.items()}
    try:
        config = config_class(**top, **sections)
    except ConfigError as exc:
        problems.extend(str(exc).splitlines()[1:])
    if problems:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(p.strip() for p in problems))
    return config


def _all_leaves(config_class: type = TrainConfig) -> Iterator[tuple[str, dataclasses.Field, Any]]:
    for f, hint in _leaf_fields(config_class):
        yield "", f, hint
    for section, default in _section_defaults(config_class).items():
        for f, hint in _leaf_fields(type(default)):
            yield section, f, hint


def _convert(raw: Any, hint: Any) -> Any:
    if typing.get_origin(hint) is Literal:
        choices = typing.get_args(hint)
        if raw not in choices:
            raise ValueError(f"{raw!r} is not one of {', '.join(map(repr, choices))}")
        return raw
    if hint is bool:
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{raw!r} is not a boolean")
    if hint is int:
        if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
            raise ValueError(f"{raw!r} is not an integer")
        try:
            return int(raw)
        except (TypeError, ValueError):
            raise ValueError(f"{raw!r} is not an integer") from None
    if hint is float:
        try:
            value = float(raw)
        except (TypeError, ValueError):
            raise ValueError(f"{raw!r} is not a number") from None
        if math.isnan(value):
            raise ValueError("NaN is not allowed")
        return value
    if hint is str:
        if not isinstance(raw, str):
            raise ValueError(f"{raw!r} is not a string")
        return raw
    raise TypeError(f"unsupported config type {hint!r}")  # a bug in this module, not user input


def to_dict(config: TrainConfig) -> dict[str, Any]:
    """The config as nested plain dicts (for manifests and logs)."""
    return dataclasses.asdict(config)

"""Did the job lose anything? Facts from a chaos run, a clean reference run, and pure checks over them.

The runner collects facts at its edges (the job's ``events.jsonl``, the torchrun agents' log lines,
rank 0's ``metrics.jsonl``, the commits it watched, the final checkpoint); everything between is a
pure function of those facts:

- :func:`job_events` turns the runtime's event records (:mod:`elastic_ddp.events`) into
  :class:`JobEvent` s, each placed on its node by the torchrun agent's pid it carries;
  :func:`parse_agent_log` adds the few torchrun agent lines the recovery figures need;
- :func:`run_checks` returns one :class:`Check` per property, each named, each failure message
  naming the step (or node, or line) it is about. A check whose events are missing fails: a run
  that should have resumed and has no resume event is a failed run, not one with nothing to check;
- :func:`fault_metrics` and :func:`goodput` measure recovery.

The sample ledger (``samples.jsonl``, written by rank 0 with ``--log-sample-ledger``) lists every committed
step's sample ids; :func:`check_ledger` takes each step's last line (the lineage that reached the final model)
and counts the samples trained on twice and the positions skipped.

The reference is the same job under ``torchrun --standalone`` at the scenario's starting world
size, without faults, cached by a hash of the job (:func:`reference_run`). It commits a
checkpoint at the same cadence and keeps them all, so the data digest of every step the chaos
run committed can be compared with the reference's at that step.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from chaos.cluster import SHARD_CACHE_DIR_ENV, Node
from chaos.faults import Commit, FaultRecord
from chaos.scenario import REPO, ChaosError, JobConfig
from elastic_ddp.events import SAMPLES_FILE, Event, LedgerEntry, read_ledger

logger = logging.getLogger(__name__)

WORLD_CHANGE_RTOL = 1e-4
WORLD_CHANGE_ATOL = 1e-6
"""Tolerance for final weights after a world-size change (the project's, see tests/jobs.py): the same
samples are summed in another order (per-rank partial sums, then the all-reduce), so weights differ by
floating-point reassociation only."""


class VerifyError(ChaosError):
    """The reference run failed, or a checkpoint could not be read back for the checks."""


# -- facts -------------------------------------------------------------------------------


@dataclass(frozen=True)
class JobEvent:
    """One thing that happened in the job: a worker's event (``kind`` is an :class:`elastic_ddp.events.Event`
    value) or a torchrun agent's log line (``kind`` is one of :data:`AGENT_KINDS`)."""

    time: float
    node: str
    kind: str
    rank: int | None = None
    step: int | None = None
    path: str = ""
    world_size: int | None = None
    reason: str = ""
    text: str = ""
    """The error or detail it carries (an agent line: the line)."""
    source: str = ""
    """Where a ``resumed`` event's state came from: ``storage``, ``replica`` or ``live`` (kept in its process)."""
    pid: int | None = None
    """The worker process that wrote it (None for an agent's line)."""


@dataclass(frozen=True)
class StepRecord:
    """One step as rank 0 logged it in ``metrics.jsonl``."""

    step: int
    time: float
    world_size: int
    step_time_s: float


@dataclass(frozen=True)
class NodeOutcome:
    """How a node's agent ended: ``returncode`` None if it still ran when the run ended."""

    name: str
    returncode: int | None
    removed_by: str = ""
    """The fault that took it out of the job, if one did."""
    arrived_late: bool = False
    """It never trained: its agent found the rendezvous closed because the job had finished
    (torchrun's agent then exits 1 with ``RendezvousClosedError``; nothing of the job is lost)."""


@dataclass(frozen=True)
class CheckpointFacts:
    """A checkpoint read back and verified: position, digests, world size."""

    path: str
    step: int
    world_size: int
    model_digest: str
    data_digest: str


@dataclass(frozen=True)
class WeightComparison:
    """Final weights of the chaos run against the reference's."""

    bitwise: bool
    allclose: bool
    max_abs_diff: float
    worst_tensor: str


@dataclass(frozen=True)
class ReferenceFacts:
    """The clean run: its final checkpoint and every committed step's data digest."""

    world_size: int
    checkpoint_uri: str
    final: CheckpointFacts
    data_digests: dict[int, str]
    wall_s: float


NOT_REACHED = "the job ended before its trigger"
"""Why a fault that was still waiting when the job finished did not fire."""


@dataclass
class RunFacts:
    """Everything the checks and metrics need from one chaos run."""

    scenario: str
    max_steps: int
    open_schedule: bool
    started_at: float
    ended_at: float
    timed_out: bool
    nodes: list[NodeOutcome]
    faults: list[FaultRecord]
    steps: list[StepRecord]
    events: list[JobEvent]
    commits: list[Commit]
    final: CheckpointFacts | None
    final_error: str
    reference: ReferenceFacts
    weights: WeightComparison | None = None
    event_problems: list[str] = field(default_factory=list)
    """Lines of the events file that are not valid events (or why there is no events file)."""
    ledger: LedgerFacts | None = None
    """The job's sample ledger as read back; None: not read (no ``sample-ledger`` check)."""
    in_process: bool = False
    """The job ran in the etcd-v3 handler's in-process mode: the ``survivors-kept-processes`` check is made."""
    nproc_per_node: int = 1


@dataclass(frozen=True)
class LedgerFacts:
    """The job's sample ledger: its valid entries in file order and its unreadable lines; ``missing``: why there
    is none (a script that does not write one), and then nothing else is set."""

    entries: list[LedgerEntry] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    missing: str = ""


@dataclass(frozen=True)
class Check:
    name: str
    passed: bool
    message: str
    skipped: bool = False
    """The check could not be made (its facts are absent; ``message`` says why): neither a pass nor a failure,
    and it does not fail the run (``passed`` is True so that the verdict stands on the checks that were made)."""


# -- events (pure) -----------------------------------------------------------------------------

AGENT_KINDS = ("agent-failure", "new-nodes", "agent-signal", "agent-rendezvous")
"""What the verifier reads from the torchrun agents' own log lines (torch writes them; the runtime's facts
come from its events file)."""

DETECTION_KINDS = frozenset({Event.EXIT, Event.STOP_REQUESTED, Event.STOP_AGREED, Event.WATCHDOG_FIRED,
                             Event.PROCESS_GROUP_FORMED, "agent-failure", "new-nodes", "agent-signal"})
"""Events that show the job noticed something: a worker exiting (other than at the end), a stop requested or
agreed, the watchdog, a process group formed (in-process, the survivors re-form before any agent sees the
fault), the agent seeing a failure, a waiting node, or a signal."""

ATTEMPT_START = (Event.RESUMED, Event.STARTED_FRESH)
"""How every attempt of the job begins, on every rank."""


def job_events(records: Iterable[Mapping[str, Any]], nodes: Mapping[int, str]) -> list[JobEvent]:
    """The runtime's event records (valid ones, :func:`elastic_ddp.events.parse_events`) as job events;
    ``nodes`` names each node by its torchrun agent's pid."""
    events = []
    for record in records:
        agent = record.get("agent_pid")
        node = nodes.get(agent, f"agent {agent}") if isinstance(agent, int) else str(record.get("host", "?"))
        text = record.get("error") or record.get("detail") or ""
        events.append(JobEvent(float(record["time"]), node, str(record["event"]), rank=record["rank"],
                               step=_int(record.get("step")), path=str(record.get("path", "")),
                               world_size=_int(record.get("world_size")), reason=str(record.get("reason", "")),
                               text=str(text), source=str(record.get("source", "")), pid=_int(record.get("pid"))))
    return events


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


_AGENT_LINE = re.compile(r"^([IWEF])(\d{4}) (\d\d:\d\d:\d\d)\.(\d+) +\d+ [^\]]*\] (.*)$")
_AGENT_PATTERNS: list[tuple[str, re.Pattern[str]]] = [
    ("agent-failure", re.compile(r"failed \(exitcode: -?\d+\) local_rank|Worker group (FAILED|UNHEALTHY)")),
    ("new-nodes", re.compile(r"Detected \d+ new nodes")),
    ("agent-signal", re.compile(r"Received \S+ death signal")),
    ("agent-rendezvous", re.compile(r"Rendezvous complete for workers")),
]


def parse_agent_log(text: str, node: str, year: int) -> list[JobEvent]:
    """The torchrun agent's lines in one node's log that the recovery figures use (``year``: torch's lines
    carry only month and day).

    torch writes these lines and has no structured record of them, so they are matched as text: a failed
    worker, a waiting node, a signal to the agent, a completed rendezvous round. Everything the runtime
    itself decides is read from its events file instead (:func:`job_events`)."""
    events = []
    for line in text.splitlines():
        match = _AGENT_LINE.match(line)
        if not match:
            continue
        _, month_day, clock, fraction, message = match.groups()
        for kind, pattern in _AGENT_PATTERNS:
            if pattern.search(message):
                stamp = time.mktime(time.strptime(f"{year}{month_day} {clock}", "%Y%m%d %H:%M:%S"))
                events.append(JobEvent(stamp + float(f"0.{fraction}"), node, kind, text=message))
                break
    return events


def noticed(event: JobEvent) -> bool:
    """Whether ``event`` shows the job noticed something (a normal end is not a detection)."""
    return event.kind in DETECTION_KINDS and not (event.kind == Event.EXIT and event.reason == "done")


def parse_metrics(lines: Iterable[str]) -> list[StepRecord]:
    """Rank 0's per-step records (the lines with a loss); a half-written last line, and any line that is not
    a step record, is skipped."""
    records = []
    for line in lines:
        try:
            record = json.loads(line)
            if isinstance(record, dict) and "loss" in record:
                records.append(StepRecord(int(record["step"]), float(record["time"]), int(record["world_size"]),
                                          float(record.get("step_time_s", 0.0))))
        except (ValueError, TypeError, KeyError):
            continue
    return records


def step_dir(path: str) -> str:
    """``step-00000040`` of a checkpoint path or URI."""
    return path.rstrip("/").rsplit("/", 1)[-1]


# -- checks (pure) --------------------------------------------------------------------------


def run_checks(facts: RunFacts) -> list[Check]:
    """Every check, in a fixed order."""
    return [
        check_events(facts.event_problems, facts.events, facts.steps),
        check_finished(facts),
        check_faults_fired(facts.faults, facts.open_schedule),
        check_survivors(facts.nodes),
        check_final_checkpoint(facts.final, facts.final_error, facts.max_steps),
        check_data(facts.commits, facts.reference, facts.final),
        check_weights(facts.steps, facts.final, facts.reference, facts.weights),
        check_loads(facts.events, facts.commits, facts.faults, facts.steps),
        *([check_ledger(facts.ledger, facts.final)] if facts.ledger is not None else []),
        *([check_kept_processes(facts.events, facts.faults, facts.nproc_per_node)] if facts.in_process else []),
    ]


def check_events(problems: list[str], events: list[JobEvent], steps: list[StepRecord]) -> Check:
    """The events file was there and every line of it a valid event: the other checks read it, and a line
    that is not an event may be one they need."""
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        return Check("events-file", False, "; ".join(problems[:3]) + more)
    ranks = {(event.node, event.rank) for event in events if event.kind not in AGENT_KINDS}
    if steps and not ranks:
        return Check("events-file", False, f"{len(steps)} steps logged but no worker wrote an event")
    return Check("events-file", True, f"{sum(event.kind not in AGENT_KINDS for event in events)} events, every line valid")


def check_finished(facts: RunFacts) -> Check:
    done = [event for event in facts.events if event.kind == Event.DONE]
    if facts.timed_out:
        last = facts.steps[-1].step if facts.steps else 0
        return Check("job-finished", False, f"still running at the deadline, last step logged {last} of {facts.max_steps}")
    if not done:
        last = facts.steps[-1].step if facts.steps else 0
        return Check("job-finished", False, f"every node exited but no rank wrote a 'done' event; last step logged {last}")
    return Check("job-finished", True, f"done at step {done[-1].step} after {facts.ended_at - facts.started_at:.0f} s")


def check_faults_fired(faults: list[FaultRecord], open_schedule: bool = False) -> Check:
    """Every fault fired; with an open schedule, those the job outlived (not reached) may be left."""
    missed = [f"{record.label} ({record.skipped or 'never triggered'})" for record in faults
              if not record.fired and not (open_schedule and record.skipped == NOT_REACHED)]
    if missed:
        return Check("faults-fired", False, "not fired: " + "; ".join(missed))
    fired = sum(record.fired for record in faults)
    if fired < len(faults):
        return Check("faults-fired", True, f"{fired} fault(s) fired; the job finished before the other "
                     f"{len(faults) - fired} of its open schedule")
    return Check("faults-fired", True, f"all {len(faults)} fault(s) fired")


def check_survivors(nodes: list[NodeOutcome]) -> Check:
    survivors = [node for node in nodes if not node.removed_by and not node.arrived_late]
    late = [node.name for node in nodes if node.arrived_late and not node.removed_by]
    bad = [f"{node.name} exited {node.returncode}" if node.returncode is not None else f"{node.name} still ran at the end"
           for node in survivors if node.returncode != 0]
    note = f"; {', '.join(late)} arrived after the job had finished (rendezvous closed)" if late else ""
    if not survivors:
        return Check("survivors-exit-0", False, "no node survived the scenario" + note)
    if bad:
        return Check("survivors-exit-0", False, "; ".join(bad) + note)
    return Check("survivors-exit-0", True, f"{', '.join(node.name for node in survivors)} exited 0" + note)


_WORKER_TARGET = re.compile(r"^rank (\d+)")


def check_kept_processes(events: list[JobEvent], faults: list[FaultRecord], nproc_per_node: int) -> Check:
    """In-process mode: every node that no fault hit (a worker of it killed, the node itself taken) ran each of
    its workers in one process from its first attempt to its end, and at least one node did: the survivors of a
    membership change keep their processes; only the workers a fault hit are started again."""
    name = "survivors-kept-processes"
    workers = [event for event in events if event.pid is not None and event.kind not in AGENT_KINDS]
    hit = {record.target for record in faults if record.fired and record.kind != "add-node"}  # one it starts
    for record in faults:  # a worker fault names a rank: the node whose worker held it last before the fault
        match = _WORKER_TARGET.match(record.target)
        if record.fired_at is not None and match:
            held = [event for event in workers if event.rank == int(match.group(1)) and event.time <= record.fired_at]
            hit |= {max(held, key=lambda event: event.time).node} if held else set()
    pids: dict[str, list[int]] = {}
    for event in sorted(workers, key=lambda event: event.time):
        if event.pid not in pids.setdefault(event.node, []):
            pids[event.node].append(event.pid)  # type: ignore[arg-type]
    survivors = sorted(node for node in pids if node not in hit)
    if not survivors:
        return Check(name, False, f"every node that trained was hit by a fault ({', '.join(sorted(pids))}): no survivor "
                     "to check")
    restarted = [f"{node}: {len(pids[node])} worker processes ({', '.join(map(str, pids[node]))}) for "
                 f"{nproc_per_node} worker(s)" for node in survivors if len(pids[node]) > nproc_per_node]
    if restarted:
        return Check(name, False, "; ".join(restarted) + " although no fault hit it")
    return Check(name, True, f"{', '.join(f'{node} ({len(pids[node])} process(es))' for node in survivors)} kept their "
                 f"worker processes through {sum(record.fired for record in faults)} fault(s)")


def check_final_checkpoint(final: CheckpointFacts | None, error: str, max_steps: int) -> Check:
    if final is None:
        return Check("final-checkpoint", False, error or "no committed checkpoint")
    if final.step != max_steps:
        return Check("final-checkpoint", False, f"the newest committed checkpoint is step {final.step}, not {max_steps}")
    return Check("final-checkpoint", True, f"{step_dir(final.path)} verifies (every file's size and digest)")


def check_data(commits: list[Commit], reference: ReferenceFacts, final: CheckpointFacts | None) -> Check:
    """Every checkpoint the run committed holds the reference's data digest at its step: exactly the
    samples of an uninterrupted run were consumed up to it, whatever the world size."""
    compared = sorted({(commit.step, commit.data_digest) for commit in commits if commit.step in reference.data_digests})
    good = 0
    for step, digest in compared:
        expected = reference.data_digests[step]
        if digest != expected:
            return Check("data-digest", False,
                         f"the checkpoint of step {step} consumed other samples than the reference run "
                         f"(data digest {digest[:12]}… != {expected[:12]}…); last matching checkpoint: step {good}")
        good = step
    if final is None:
        return Check("data-digest", False,
                     f"no final checkpoint to compare; {len(compared)} checkpoints matched up to step {good}")
    if final.data_digest != reference.final.data_digest:
        return Check("data-digest", False, f"the final checkpoint (step {final.step}) consumed other samples than the reference "
                     f"(data digest {final.data_digest[:12]}… != {reference.final.data_digest[:12]}…)")
    return Check("data-digest", True, f"{len(compared)} checkpoints up to step {good} match the reference's data digests")


def final_lineage(entries: Iterable[LedgerEntry]) -> dict[int, LedgerEntry]:
    """Step -> the last line written for it (``entries`` in file order): a step redone after a restart is
    written again, and its last execution is the one that reached the final model."""
    return {entry.step: entry for entry in entries}


@dataclass(frozen=True)
class LedgerAudit:
    """Steps ``1..final`` of a ledger's final lineage, counted."""

    steps: int
    """Steps that have a line."""
    samples: int
    duplicates: int
    """Sample ids seen again in the same epoch (each repeat counts once)."""
    gaps: int
    """Steps without a line, and steps whose positions do not continue the previous step's."""
    findings: list[str]
    """What each duplicate and gap is, in step order, naming the step."""
    lineage: list[LedgerEntry]
    """The entries of steps 1..final, in step order."""


def audit_ledger(entries: Iterable[LedgerEntry], final_step: int) -> LedgerAudit:
    """Duplicates and gaps in the final lineage of steps ``1..final_step``.

    Positions must be contiguous: step 1 starts at epoch 0, position 0; each later step starts where the
    previous one stopped in the same epoch, or at position 0 of the next epoch (an epoch's tail that
    ``drop_last`` skips is not a gap: the ledger does not know the dataset's size). Every line holds
    ``stop - start`` ids (:func:`elastic_ddp.events.check_ledger_record`), so with contiguous positions and no
    id repeated within an epoch, the ids of each epoch's covered prefix are exactly as many distinct samples
    as positions covered."""
    lineage = final_lineage(entries)
    findings: list[str] = []
    duplicates = gaps = samples = 0
    first_seen: dict[int, dict[int, int]] = {}  # epoch -> sample id -> the step that held it first
    kept: list[LedgerEntry] = []
    previous: LedgerEntry | None = None
    for step in range(1, final_step + 1):
        entry = lineage.get(step)
        if entry is None:
            gaps += 1
            findings.append(f"step {step}: no line in the ledger")
            previous = None
            continue
        problem = _discontinuity(previous, entry) if previous is not None or step == 1 else ""
        if problem:
            gaps += 1
            findings.append(f"step {step}: {problem}")
        seen = first_seen.setdefault(entry.epoch, {})
        for sample in entry.ids:
            if sample in seen:
                duplicates += 1
                findings.append(f"step {step}: sample {sample} of epoch {entry.epoch} was already in step {seen[sample]}")
            else:
                seen[sample] = step
        samples += len(entry.ids)
        kept.append(entry)
        previous = entry
    return LedgerAudit(len(kept), samples, duplicates, gaps, findings, kept)


def _discontinuity(previous: LedgerEntry | None, entry: LedgerEntry) -> str:
    """Why ``entry``'s positions do not continue ``previous``'s (None: the run's first step), or ""."""
    here = f"positions [{entry.start}, {entry.stop}) of epoch {entry.epoch}"
    if previous is None:
        return "" if (entry.epoch, entry.start) == (0, 0) else f"the first step holds {here}, not the run's beginning"
    if entry.epoch == previous.epoch and entry.start != previous.stop:
        return f"{here} after step {previous.step}'s [{previous.start}, {previous.stop})"
    if entry.epoch == previous.epoch + 1 and entry.start != 0:
        return f"a new epoch begins at {here}, not at position 0"
    if entry.epoch not in (previous.epoch, previous.epoch + 1):
        return f"{here} after step {previous.step} in epoch {previous.epoch}"
    return ""


def ledger_digest(lineage: Iterable[LedgerEntry]) -> str:
    """The data digest the steps of ``lineage`` chain to (:func:`elastic_ddp.data.update_data_digest`)."""
    import torch

    from elastic_ddp.data import EMPTY_DATA_DIGEST, update_data_digest

    digest = EMPTY_DATA_DIGEST
    for entry in lineage:
        digest = update_data_digest(digest, torch.tensor(entry.ids, dtype=torch.int64))
    return digest


def check_ledger(ledger: LedgerFacts, final: CheckpointFacts | None) -> Check:
    """The samples that went into the final model, from the sample ledger: steps 1 to the final checkpoint's
    (each step's last line) hold no sample twice in an epoch and skip no position, and chain to the final
    checkpoint's data digest (the ledger describes the data the checkpoint recorded). Lines that are not valid
    entries are named; a crash may cut the last line of an attempt short, and its step is redone. No ledger:
    skipped."""
    name = "sample-ledger"
    if ledger.missing:
        return Check(name, True, f"skipped: {ledger.missing}", skipped=True)
    final_step = final.step if final is not None else max((entry.step for entry in ledger.entries), default=0)
    unreadable = ""
    if ledger.problems:
        more = f" (and {len(ledger.problems) - 2} more)" if len(ledger.problems) > 2 else ""
        unreadable = f"; {len(ledger.problems)} unreadable line(s) not used: {'; '.join(ledger.problems[:2])}{more}"
    if final_step == 0:
        return Check(name, False, "the sample ledger holds no step" + unreadable)
    audit = audit_ledger(ledger.entries, final_step)
    counts = (f"ledger: {audit.samples:,} samples in {audit.steps} steps, {audit.duplicates} duplicates, "
              f"{audit.gaps} gaps")
    if audit.duplicates or audit.gaps:
        more = f" (and {len(audit.findings) - 3} more)" if len(audit.findings) > 3 else ""
        return Check(name, False, f"{counts}: {'; '.join(audit.findings[:3])}{more}{unreadable}")
    if final is None:
        return Check(name, False, f"{counts} up to step {final_step}, but no final checkpoint to tie it to{unreadable}")
    chained = ledger_digest(audit.lineage)
    if chained != final.data_digest:
        return Check(name, False, f"{counts}, but steps 1-{final_step} chain to data digest {chained[:12]}…, not the "
                     f"final checkpoint's {final.data_digest[:12]}…{unreadable}")
    return Check(name, True, f"{counts}; steps 1-{final_step} chain to the final checkpoint's data digest{unreadable}")


def check_weights(steps: list[StepRecord], final: CheckpointFacts | None, reference: ReferenceFacts,
                  weights: WeightComparison | None) -> Check:
    """Bitwise equal to the reference when every step ran at its world size, else within the tolerance."""
    if final is None:
        return Check("model-weights", False, "no final checkpoint to compare")
    worlds = sorted({record.world_size for record in steps})
    if worlds == [reference.world_size]:
        if final.model_digest == reference.final.model_digest:
            return Check("model-weights", True, f"bitwise equal to the reference at step {final.step} (world size {worlds[0]})")
        return Check("model-weights", False, f"step {final.step}: model digest {final.model_digest[:12]}… != reference "
                     f"{reference.final.model_digest[:12]}… although the world size never changed ({worlds[0]})")
    if weights is None:
        return Check("model-weights", False, f"step {final.step}: the weights could not be compared")
    within = f"rtol={WORLD_CHANGE_RTOL:g}, atol={WORLD_CHANGE_ATOL:g}"
    if not weights.allclose:
        return Check("model-weights", False, f"step {final.step}: {weights.worst_tensor} differs by {weights.max_abs_diff:.3g} "
                     f"from the reference, beyond {within} (world sizes {worlds})")
    return Check("model-weights", True, f"step {final.step}: within {within} of the reference (max |diff| "
                 f"{weights.max_abs_diff:.3g}, world sizes {worlds})")


def check_loads(events: list[JobEvent], commits: list[Commit], faults: list[FaultRecord],
                steps: list[StepRecord]) -> Check:
    """Every attempt of the job began by resuming from a checkpoint committed before it (and not un-committed
    or corrupted since), or fresh when nothing had been committed; no restore failed half-way.

    The events must show it: an attempt seen in the step records (a step redone, the world size changed) or
    in the events (a process group formed, a worker that exited for a fault) without rank 0's ``resumed``
    or ``started_fresh`` event fails the check; zero resumes where the run needed one is not a pass."""
    name = "no-partial-load"
    failed = [event for event in events if event.kind == Event.RESTORE_FAILED]
    if failed:
        first = failed[0]
        return Check(name, False, f"{first.node} rank {first.rank}: restore failed: {first.text[:300]}")
    starts = sorted((event for event in events if event.kind in ATTEMPT_START and event.rank == 0),
                    key=lambda event: event.time)
    problem = _unrecorded_attempt(starts, events, steps, faults) or _needless_fresh_start(starts, events, commits)
    if problem:
        return Check(name, False, problem)
    resumes = [event for event in events if event.kind == Event.RESUMED]
    for resume in resumes:
        problem = _resume_problem(resume, events, commits, faults)
        if problem:
            return Check(name, False, f"resume at step {resume.step} ({resume.node} rank {resume.rank}): {problem}")
    resumed = sum(start.kind == Event.RESUMED for start in starts)
    return Check(name, True, f"{len(starts)} attempt(s), {resumed} resumed, each from a checkpoint committed and "
                 "intact at the time")


def _unrecorded_attempt(starts: list[JobEvent], events: list[JobEvent], steps: list[StepRecord],
                        faults: list[FaultRecord]) -> str:
    """Why some attempt of the job has no start recorded by rank 0, or "" when each has one."""
    if steps and not starts:
        return "no 'resumed' or 'started_fresh' event from rank 0: the events do not say how the job began"
    times = [start.time for start in starts]

    def started(after: float, until: float = float("inf")) -> bool:
        return any(after < when <= until for when in times)

    ordered = sorted(steps, key=lambda record: record.time)
    for previous, record in itertools.pairwise(ordered):
        new_attempt = record.step <= previous.step or record.world_size != previous.world_size
        if new_attempt and not started(previous.time, record.time):
            return (f"step {record.step} at world size {record.world_size} came after step {previous.step} at world size "
                    f"{previous.world_size}, in a new attempt, but rank 0 recorded no resume (or fresh start) between them")
    formed = sorted(event.time for event in events if event.kind == Event.PROCESS_GROUP_FORMED and event.rank == 0)
    for at, until in zip(formed, [*formed[1:], float("inf")]):
        first = next((record for record in ordered if at < record.time < until), None)
        if first is not None and not started(at, first.time):
            return (f"an attempt formed its process group at {_clock(at)} and trained (step {first.step} at "
                    f"{_clock(first.time)}) without a resume (or fresh start) recorded by rank 0")
    for fault in faults:
        if fault.fired_at is None or started(fault.fired_at):
            continue
        after = fault.fired_at
        ended = _earliest(event for event in events if event.time > after
                          and ((event.kind == Event.EXIT and event.reason != "done")
                               or (event.kind == Event.PROCESS_GROUP_FORMED and event.rank == 0)))
        if ended is not None:
            what = f"{ended.kind} {ended.reason}" if ended.reason else ended.kind
            return (f"fault {fault.label} was followed by a new attempt ({ended.node} rank {ended.rank}: {what}), "
                    "but rank 0 recorded no resume after it")
    return ""


def _needless_fresh_start(starts: list[JobEvent], events: list[JobEvent], commits: list[Commit]) -> str:
    """Why an attempt that started fresh should have resumed (a checkpoint was committed before it), or ""."""
    for start in starts:
        if start.kind != Event.STARTED_FRESH:
            continue
        committed = [event.step for event in events
                     if event.kind == Event.COMMITTED and event.step is not None and event.time < start.time]
        committed += [commit.step for commit in commits if commit.seen_at < start.time]
        if committed:
            return (f"rank 0 started fresh at {_clock(start.time)} ({start.reason}) although step {max(committed)} "
                    "had been committed before")
    return ""


def _clock(when: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(when)) + f".{int(when * 1000) % 1000:03d}"


def _resume_problem(resume: JobEvent, events: list[JobEvent], commits: list[Commit], faults: list[FaultRecord]) -> str:
    if resume.source == "live":  # an in-process re-formation kept the state it had: nothing was loaded
        return ""
    if resume.source == "replica":
        saved = [event for event in events if event.kind == Event.REPLICA_SAVED and event.step == resume.step
                 and event.time <= resume.time]
        return "" if saved else f"no node recorded a replica of step {resume.step} before it was loaded"
    name = step_dir(resume.path)
    committed_at = [event.time for event in events if event.kind == Event.COMMITTED and step_dir(event.path) == name
                    and event.time <= resume.time]
    committed_at += [commit.seen_at for commit in commits if f"step-{commit.step:08d}" == name and commit.seen_at <= resume.time]
    if not committed_at:
        return f"{name} was never seen committed before it was loaded"
    last_commit = max(committed_at)
    for event in events:
        if event.kind == Event.UNCOMMITTED and step_dir(event.path) == name and last_commit < event.time <= resume.time:
            return f"{name} was un-committed before it was loaded and not committed again"
    for record in faults:
        if (record.kind == "corrupt-checkpoint" and record.fired_at is not None and f"/{name}/" in record.target
                and last_commit < record.fired_at <= resume.time):
            return f"{name} was loaded although chaos corrupted {record.target} after its last commit"
    return ""


# -- recovery metrics (pure) -------------------------------------------------------------------


@dataclass(frozen=True)
class FaultMetrics:
    """How the job recovered from one fault (None: not observed)."""

    detect_s: float | None = None
    """Fault -> the first event showing the job noticed (an exit, a stop agreed, the agent seeing a failure)."""
    agents_rendezvous_s: float | None = None
    """Fault -> the first rendezvous round the torchrun agents completed after it was noticed."""
    rendezvous_s: float | None = None
    """Fault -> the first process group formed after it: the new workers started and met (a new generation)."""
    first_step_s: float | None = None
    """Fault -> the first step completed after that rendezvous."""
    steps_redone: int | None = None
    """Newest step logged before the resume minus the step resumed from."""
    resumed_step: int | None = None
    world_size_after: int | None = None
    stall_s: float | None = None
    """The longest time without a completed step, from the fault until the next one (or the end)."""
    overlapped: bool = False
    """The next fault fired before this one's recovery was complete."""


def fault_metrics(record: FaultRecord, events: list[JobEvent], steps: list[StepRecord],
                  next_fault_at: float | None) -> FaultMetrics:
    """Recovery figures for one fired fault, from the job's events and step records after it.

    Only a detection before ``next_fault_at`` counts (a fault the job did not notice by then gets no figures);
    the recovery it started may end after the next fault fired (``overlapped``).
    """
    if record.fired_at is None:
        return FaultMetrics()
    start = record.fired_at - 0.002  # torchrun's log stamps are truncated to milliseconds
    window_end = next_fault_at if next_fault_at is not None else float("inf")
    detected = _earliest(event for event in events if noticed(event) and start <= event.time < window_end)
    stall = longest_stall(record.fired_at, steps, window_end)
    if detected is None:  # not noticed before the next fault: whatever follows is that one's
        return FaultMetrics(stall_s=stall)
    agents = _earliest(event for event in events if event.kind == "agent-rendezvous" and event.time >= detected.time)
    formed = _earliest(event for event in events if event.kind == Event.PROCESS_GROUP_FORMED and event.time >= detected.time)
    first_step = _earliest(step for step in steps if formed is not None and step.time > formed.time)
    resumed = _earliest(event for event in events if event.kind == Event.RESUMED and event.time >= start)
    redone = None
    if resumed is not None and resumed.step is not None:
        before = [step.step for step in steps if step.time < resumed.time]
        redone = max(0, max(before, default=0) - resumed.step)
    end = first_step.time if first_step is not None else None
    return FaultMetrics(
        detect_s=_since(detected.time, record.fired_at),
        agents_rendezvous_s=_since(agents.time if agents else None, record.fired_at),
        rendezvous_s=_since(formed.time if formed else None, record.fired_at),
        first_step_s=_since(end, record.fired_at),
        steps_redone=redone,
        resumed_step=resumed.step if resumed else None,
        world_size_after=first_step.world_size if first_step else None,
        stall_s=stall,
        overlapped=next_fault_at is not None and (end is None or end > next_fault_at),
    )


def longest_stall(since: float, steps: list[StepRecord], until: float) -> float | None:
    """The longest gap without a completed step between ``since`` and ``until`` (None: no step in between)."""
    times = [since, *sorted(step.time for step in steps if since < step.time < until)]
    if len(times) < 2:
        return None
    return max(later - earlier for earlier, later in zip(times, times[1:]))


SIMULTANEOUS_S = 1.0
"""Faults fired this close together are one event: they share the recovery figures."""


def all_fault_metrics(facts: RunFacts) -> list[FaultMetrics]:
    """:func:`fault_metrics` for every fault; what the job noticed counts for a fault only until the next
    fault fired (more than :data:`SIMULTANEOUS_S` later)."""
    times = sorted(record.fired_at for record in facts.faults if record.fired_at is not None)
    result = []
    for record in facts.faults:
        later = [when for when in times if record.fired_at is not None and when > record.fired_at + SIMULTANEOUS_S]
        result.append(fault_metrics(record, facts.events, facts.steps, min(later, default=None)))
    return result


def goodput(steps: list[StepRecord], attempt_starts: list[float], started_at: float, ended_at: float) -> float:
    """Share of the wall time spent on steps that reached the final model.

    A step's time is the gap since the previous step of the same attempt (attempts begin at each
    resume or fresh start), or its own ``step_time_s`` when it is an attempt's first. Of every step
    number only the last execution reached the final model; earlier ones were lost to a failure and redone.
    """
    total = ended_at - started_at
    if total <= 0 or not steps:
        return 0.0
    final: dict[int, float] = {}
    previous: StepRecord | None = None
    for record in sorted(steps, key=lambda item: item.time):
        same_attempt = previous is not None and _attempt(previous.time, attempt_starts) == _attempt(record.time, attempt_starts)
        if same_attempt and previous is not None and record.step == previous.step + 1:
            final[record.step] = record.time - previous.time
        else:
            final[record.step] = record.step_time_s
        previous = record
    return min(1.0, sum(final.values()) / total)


def first_step_began(steps: list[StepRecord]) -> float | None:
    """When the run's first step began (its record's time minus its step time)."""
    first = min(steps, default=None, key=lambda step: step.time)
    return None if first is None else first.time - first.step_time_s


def attempt_starts(events: list[JobEvent]) -> list[float]:
    """When each attempt of the job began (rank 0's ``resumed`` or ``started_fresh`` event)."""
    return sorted(event.time for event in events if event.kind in ATTEMPT_START and event.rank == 0)


def _attempt(when: float, starts: list[float]) -> int:
    return sum(start <= when for start in starts)


def _earliest(items: Iterable[Any]) -> Any:
    """The item with the smallest ``.time``, or None."""
    return min(items, default=None, key=lambda item: item.time)


def _since(when: float | None, origin: float) -> float | None:
    return None if when is None else max(0.0, when - origin)


# -- the reference run and reading checkpoints back (I/O) ----------------------------------------


def reference_key(job: JobConfig, world_size: int) -> str:
    """The cache key of a reference run: the job's arguments, steps, cadence and world size, and the code that
    runs it (the script's directory and the runtime's sources, torch's version): a changed line runs it anew."""
    import torch

    body = json.dumps([os.path.relpath(job.script, REPO), list(job.args), job.max_steps, job.checkpoint_every, world_size,
                       torch.__version__, _sources_digest(Path(job.script).parent, REPO / "elastic_ddp"),
                       *([list(job.data_write), job.data_uri_flag] if job.data_write else [])])
    return hashlib.sha256(body.encode()).hexdigest()[:16]


def _sources_digest(*directories: Path) -> str:
    hasher = hashlib.sha256()
    for directory in directories:
        for path in sorted(directory.rglob("*.py")):
            hasher.update(str(path.relative_to(directory)).encode())
            hasher.update(path.read_bytes())
    return hasher.hexdigest()


REFERENCE_TIMEOUT_S = 900.0
"""The least time a reference run gets (a scenario with a longer ``timeout_s`` gives it that)."""


def reference_run(job: JobConfig, world_size: int, cache_dir: Path, timeout_s: float = REFERENCE_TIMEOUT_S) -> ReferenceFacts:
    """The clean run of ``job`` at ``world_size`` under ``torchrun --standalone``: reused from ``cache_dir`` when
    an identical one ran before, else run now (its checkpoints are all kept)."""
    directory = cache_dir / f"reference-{reference_key(job, world_size)}"
    cached = directory / "facts.json"
    if cached.is_file():
        logger.info("reusing the reference run in %s", directory)
        return _facts_from_json(json.loads(cached.read_text()))
    started = time.monotonic()
    _run_reference_job(job, world_size, directory, timeout_s)
    uri = str(directory / "ckpt")
    facts = ReferenceFacts(world_size=world_size, checkpoint_uri=uri, final=read_checkpoint(uri),
                           data_digests=data_digests(uri), wall_s=time.monotonic() - started)
    cached.write_text(json.dumps(asdict(facts), indent=2))
    return facts


def _run_reference_job(job: JobConfig, world_size: int, directory: Path, timeout_s: float) -> None:
    if directory.exists():
        shutil.rmtree(directory)  # a reference that did not finish: start it over
    directory.mkdir(parents=True)
    keep = job.max_steps // job.checkpoint_every + 2
    data = []
    if job.data_write:  # the same dataset, written to a local directory: the same bytes, the same index digest
        write_data(job, str(directory / "data"), _reference_env(), timeout_s)
        data = [job.data_uri_flag, str(directory / "data")]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
               job.script, *job.args, *data, "--max-steps", str(job.max_steps), "--checkpoint-every",
               str(job.checkpoint_every), "--checkpoint-keep", str(keep), "--checkpoint-dir", str(directory / "ckpt"),
               "--log-dir", str(directory / "logs"), "--log-every", "1"]
    logger.info("reference run (world size %d): %s", world_size, " ".join(command))
    # a Node: torchrun and its workers each in their own session, all stopped by stop() on every exit path
    env = {**_reference_env(), SHARD_CACHE_DIR_ENV: str(directory / "shard-cache")}
    node = Node("reference", command, env, directory / "reference.log").start()
    try:
        code: int | None = node.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        node.stop()
    if code != 0:
        tail = node.output()[-3000:]
        raise VerifyError(f"the reference run in {directory} {'timed out' if code is None else f'exited {code}'}:\n{tail}")


def write_data(job: JobConfig, uri: str, env: dict[str, str], timeout_s: float) -> None:
    """Run the job's dataset writer (``job.data_write``) for ``uri``."""
    command = job.data_command(uri)
    logger.info("writing the job's dataset: %s", " ".join(command))
    try:
        result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as exc:
        raise VerifyError(f"the dataset writer did not finish in {timeout_s:.0f} s: {' '.join(command)}") from exc
    if result.returncode:
        raise VerifyError(f"the dataset writer exited {result.returncode}: {' '.join(command)}\n"
                          f"{(result.stdout + result.stderr)[-3000:]}")


def _reference_env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ELASTIC_DDP_FAULT"):
        env.pop(name, None)
    return env


def _facts_from_json(body: dict[str, Any]) -> ReferenceFacts:
    return ReferenceFacts(world_size=body["world_size"], checkpoint_uri=body["checkpoint_uri"],
                          final=CheckpointFacts(**body["final"]),
                          data_digests={int(step): digest for step, digest in body["data_digests"].items()},
                          wall_s=body["wall_s"])


def _manager(uri: str, options: dict[str, Any] | None) -> Any:
    from elastic_ddp.checkpoint import CheckpointManager

    return CheckpointManager(uri, rank=0, world_size=1, run_id="chaos-verify", storage_options=options)


def read_checkpoint(uri: str, options: dict[str, Any] | None = None) -> CheckpointFacts:
    """The newest committed checkpoint under ``uri``, every file verified (size and digest); raises
    CheckpointError naming the bad file when it does not verify."""
    from elastic_ddp.checkpoint.manager import deserialize
    from elastic_ddp.state import model_digest

    manager = _manager(uri, options)
    newest = next((info for info in manager.list() if info.committed), None)
    if newest is None:
        raise VerifyError(f"no committed checkpoint under {uri}")
    data = manager.verify(newest)
    manifest = newest.manifest
    model = deserialize(data[manifest.replicated_file], newest.path)["model"]
    return CheckpointFacts(path=newest.path, step=manifest.step, world_size=manifest.world_size,
                           model_digest=model_digest(model), data_digest=manifest.data_digest)


def read_ledger_facts(log_dir: Path) -> LedgerFacts:
    """The job's sample ledger in ``log_dir``, or why there is none."""
    read = read_ledger(log_dir)
    if read is None:
        return LedgerFacts(missing=f"no {SAMPLES_FILE} in {log_dir}: the job wrote no sample ledger (a script "
                           "without --log-sample-ledger)")
    entries, problems = read
    return LedgerFacts(entries, problems)


def data_digests(uri: str, options: dict[str, Any] | None = None) -> dict[int, str]:
    """Step -> data digest of every committed checkpoint under ``uri`` (from the manifests)."""
    return {info.step: info.manifest.data_digest for info in _manager(uri, options).list() if info.committed}


def final_weights(uri: str, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The model tensors of the newest committed checkpoint under ``uri``."""
    from elastic_ddp.checkpoint.manager import deserialize

    manager = _manager(uri, options)
    newest = next(info for info in manager.list() if info.committed)
    return deserialize(manager.verify(newest)[newest.manifest.replicated_file], newest.path)["model"]


def compare_weights(ours: dict[str, Any], reference: dict[str, Any]) -> WeightComparison:
    """Bitwise equality, allclose within the world-change tolerance, and the largest difference."""
    import torch

    worst, worst_name, close, bitwise = 0.0, "", True, True
    for name in sorted(reference):
        mine, theirs = ours.get(name), reference[name]
        if mine is None or mine.shape != theirs.shape:
            return WeightComparison(False, False, float("inf"), f"{name} (missing or reshaped)")
        diff = (mine.double() - theirs.double()).abs().max().item() if mine.numel() else 0.0
        bitwise = bitwise and torch.equal(mine, theirs)
        close = close and torch.allclose(mine, theirs, rtol=WORLD_CHANGE_RTOL, atol=WORLD_CHANGE_ATOL)
        if diff >= worst:
            worst, worst_name = diff, name
    return WeightComparison(bitwise, close, worst, worst_name)


def facts_summary(facts: RunFacts) -> dict[str, Any]:
    """World sizes, restarts and counts derived from the facts (for reports)."""
    return {
        "world_sizes": sorted({record.world_size for record in facts.steps}),
        "attempts": len(attempt_starts(facts.events)),
        "resumes": sum(event.kind == Event.RESUMED and event.rank == 0 for event in facts.events),
        "steps_logged": len(facts.steps),
        "commits_seen": len(facts.commits),
    }


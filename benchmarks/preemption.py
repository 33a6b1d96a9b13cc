"""How fast a preemption is absorbed: SIGTERM → emergency checkpoint committed → survivors' first step.

How to run:
  .venv/bin/python benchmarks/preemption.py [--repeats 5] [--backend c10d|etcd-v3] [--no-prefork]
      [--early-close on|off|both]

Each repeat starts 2 simulated nodes x 2 workers (chaos.cluster, --nnodes=1:2, rendezvous with
last_call_timeout=1 and a 1 s x 3 heartbeat; workers started warm unless --no-prefork), waits
until all 4 ranks train, sends SIGTERM to the second node's agent, and reads the job's
events.jsonl and metrics.jsonl:
  commit:  SIGTERM -> the "committed" event of the step every rank agreed to stop at
  resume:  SIGTERM -> the first step the survivors completed after re-forming
With etcd-v3, ``--early-close both`` (the default) runs the repeats with the round closing once
every live node joined (``early_close=true``, the default) and, alternately, with the whole last
call (``early_close=false``), and prints both side by side with their ratio. Prints medians,
ranges and every sample, next to the figure measured before early close and warm starts.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from chaos.cluster import JobSpec, LocalCluster, wait_for  # noqa: E402
from elastic_ddp.events import Event, read_events  # noqa: E402

TRAIN = str(REPO / "examples" / "train.py")
CONF = {"join_timeout": "60", "last_call_timeout": "1", "keep_alive_interval": "1", "keep_alive_max_attempt": "3"}
BEFORE_S = 2.32  # SIGTERM -> survivors' first step, etcd-v3 with warm starts, before early close existed
TARGET_S = 1.0


def records(workdir: Path) -> list[dict]:
    path = workdir / "logs" / "metrics.jsonl"
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]


def emergency_commit(workdir: Path, after: float) -> dict | None:
    """The ``committed`` event of the step at which the ranks agreed to stop after ``after``, once it is there."""
    events, _ = read_events(workdir / "logs")
    stops = [e["step"] for e in events if e["event"] == Event.STOP_AGREED and e["time"] > after]
    return next((e for e in events if e["event"] == Event.COMMITTED and stops and e["step"] == stops[0]), None)


def one_run(workdir: Path, backend: str, endpoint: str, prefork: bool, early_close: bool | None) -> tuple[float, float]:
    args = ["--max-steps", "100000", "--checkpoint-dir", str(workdir / "ckpt"), "--checkpoint-every", "100",
            "--log-dir", str(workdir / "logs"), "--log-every", "1", "--log-progress", "off"]
    conf = dict(CONF) if early_close is None else {**CONF, "early_close": str(early_close).lower()}
    spec = JobSpec(script=TRAIN, args=args, nnodes="1:2", rdzv_backend=backend, rdzv_endpoint=endpoint,
                   rdzv_conf=conf, run_id=workdir.name, max_restarts=3, prefork=prefork)
    with LocalCluster(spec, workdir) as cluster:
        _, leaving = cluster.start(2).nodes
        wait_for(lambda: (r := records(workdir)) and r[-1]["world_size"] == 4 and r[-1]["step"] >= 40, 180, "4 ranks training")
        sent = time.time()
        leaving.signal_agent(signal.SIGTERM)
        resumed = wait_for(lambda: next((r for r in records(workdir) if r["time"] > sent and r["world_size"] == 2), None),
                           180, "the survivors' first step")
        committed = wait_for(lambda: emergency_commit(workdir, sent), 60, "the emergency checkpoint's commit")
        return committed["time"] - sent, resumed["time"] - sent


def summary(samples: list[float]) -> str:
    return f"median {statistics.median(samples):.2f} s (range {min(samples):.2f}-{max(samples):.2f}, n={len(samples)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--backend", default="etcd-v3", choices=["c10d", "etcd-v3"])
    parser.add_argument("--no-prefork", dest="prefork", action="store_false",
                        help="start every worker as a fresh interpreter (imports torch on each restart)")
    parser.add_argument("--early-close", default="both", choices=["on", "off", "both"],
                        help="etcd-v3 only: close a round once every live node joined (on), wait the last call (off), or both")
    args = parser.parse_args()
    if args.backend != "etcd-v3":
        variants: list[bool | None] = [None]
    else:
        variants = {"on": [True], "off": [False], "both": [True, False]}[args.early_close]
    commits: dict[bool | None, list[float]] = {v: [] for v in variants}
    resumes: dict[bool | None, list[float]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        etcd = None
        endpoint = ""
        if args.backend == "etcd-v3":
            from tests.fixtures.etcd_proc import EtcdServer, find_etcd_binary

            etcd = EtcdServer.create(find_etcd_binary(), Path(tmp) / "etcd")
            etcd.start()
            endpoint = etcd.endpoint
        try:
            for index in range(args.repeats):
                for variant in variants:  # alternated, so drift in the machine's load hits both alike
                    name = f"run{index}-{variant}"
                    commit, resume = one_run(Path(tmp) / name, args.backend, endpoint, args.prefork, variant)
                    commits[variant].append(commit)
                    resumes[variant].append(resume)
                    print(f"{name}: SIGTERM->commit {commit:.2f} s, SIGTERM->first step after re-forming {resume:.2f} s",
                          flush=True)
        finally:
            if etcd is not None:
                etcd.stop()
    print(f"\nbackend={args.backend} prefork={args.prefork} repeats={args.repeats}")
    for variant in variants:
        label = "" if variant is None else f" early_close={str(variant).lower()}"
        print(f"{label}\n  SIGTERM -> emergency checkpoint committed: {summary(commits[variant])}")
        print(f"  SIGTERM -> survivors' first step:          {summary(resumes[variant])}"
              f"   (before: {BEFORE_S:.2f} s; target <= {TARGET_S:.1f} s)")
    if len(variants) == 2:
        ratio = statistics.median(resumes[True]) / statistics.median(resumes[False])
        print(f"early close / whole last call, survivors' first step: {ratio:.2f}x")


if __name__ == "__main__":
    main()

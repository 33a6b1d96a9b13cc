"""How fast a preemption is absorbed: SIGTERM → emergency checkpoint committed → survivors' first step.

How to run:
  .venv/bin/python benchmarks/preemption.py [--repeats 5] [--backend c10d|etcd-v3] [--prefork]

Each repeat starts 2 simulated nodes x 2 workers (chaos.cluster, --nnodes=1:2, rendezvous with
last_call_timeout=1 and a 1 s x 3 heartbeat), waits until all 4 ranks train, sends SIGTERM to
the second node's agent, and reads the job's events.jsonl and metrics.jsonl:
  commit:  SIGTERM -> the "committed" event of the step every rank agreed to stop at
  resume:  SIGTERM -> the first step the survivors completed after re-forming
Prints the medians (and every sample).
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


def one_run(workdir: Path, backend: str, endpoint: str, prefork: bool) -> tuple[float, float]:
    args = ["--max-steps", "100000", "--checkpoint-dir", str(workdir / "ckpt"), "--checkpoint-every", "100",
            "--log-dir", str(workdir / "logs"), "--log-every", "1", "--log-progress", "off"]
    spec = JobSpec(script=TRAIN, args=args, nnodes="1:2", rdzv_backend=backend, rdzv_endpoint=endpoint,
                   rdzv_conf=dict(CONF), run_id=workdir.name, max_restarts=3, prefork=prefork)
    with LocalCluster(spec, workdir) as cluster:
        _, leaving = cluster.start(2).nodes
        wait_for(lambda: (r := records(workdir)) and r[-1]["world_size"] == 4 and r[-1]["step"] >= 40, 180, "4 ranks training")
        sent = time.time()
        leaving.signal_agent(signal.SIGTERM)
        resumed = wait_for(lambda: next((r for r in records(workdir) if r["time"] > sent and r["world_size"] == 2), None),
                           180, "the survivors' first step")
        committed = wait_for(lambda: emergency_commit(workdir, sent), 60, "the emergency checkpoint's commit")
        return committed["time"] - sent, resumed["time"] - sent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--backend", default="c10d", choices=["c10d", "etcd-v3"])
    parser.add_argument("--prefork", action="store_true",
                        help="start workers through elastic_ddp.prefork (restarts do not import torch again)")
    args = parser.parse_args()
    commits, resumes = [], []
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
                commit, resume = one_run(Path(tmp) / f"run{index}", args.backend, endpoint, args.prefork)
                commits.append(commit)
                resumes.append(resume)
                print(f"run {index}: SIGTERM->commit {commit:.2f} s, SIGTERM->first step after re-forming {resume:.2f} s",
                      flush=True)
        finally:
            if etcd is not None:
                etcd.stop()
    print(f"backend={args.backend} prefork={args.prefork} repeats={args.repeats}")
    print(f"SIGTERM -> emergency checkpoint committed: median {statistics.median(commits):.2f} s")
    print(f"SIGTERM -> survivors' first step:          median {statistics.median(resumes):.2f} s")


if __name__ == "__main__":
    main()

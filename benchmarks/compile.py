"""First and steady step of the language-model example with and without ``--compile``.

How to run (it launches torchrun --standalone with --nproc ranks, default 2, on gloo itself):
  .venv/bin/python benchmarks/compile.py [--rounds 3] [--steps 40] [--nproc 2] [--mode default]

Each round trains examples/lm/train.py (the GPT of benchmarks/step_overhead.py's LM_ARGS: 4 layers,
d_model 256, context 128, a global batch of 16 sequences) for --steps steps twice, eager and compiled,
the order alternating round by round. The compiled launch gets an empty TorchInductor cache of its own
(TORCHINDUCTOR_CACHE_DIR), so its first step pays the whole compilation, as a user's first run does;
``--warm-cache`` keeps one cache for all rounds instead (a restart's or a second run's first step).
Per launch, from rank 0's records: the first step's time (``first_step`` event) and the steady step,
the median ``step_time_s`` of the steps after the first ``--settle`` (metrics.jsonl). Prints each
side's medians over the rounds (min-max), and compiled/eager ratios of the steady step per round
(median, min-max).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.step_overhead import LM_ARGS  # noqa: E402

LM_TRAIN = REPO / "examples" / "lm" / "train.py"


def launch(workdir: Path, steps: int, nproc: int, compiled: bool, mode: str, cache: Path | None) -> dict[str, float]:
    logs = workdir / ("compiled" if compiled else "eager")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if cache is not None:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(LM_TRAIN),
               *LM_ARGS, "--max-steps", str(steps), "--log-dir", str(logs), "--log-every", "1"]
    if compiled:
        command += ["--compile", "--compile-mode", mode]
    result = subprocess.run(command, check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise SystemExit(f"benchmark launch failed ({result.returncode}):\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    events = [json.loads(line) for line in (logs / "events.jsonl").read_text().splitlines()]
    (first,) = [e for e in events if e["event"] == "first_step" and e["rank"] == 0]
    metrics = [json.loads(line) for line in (logs / "metrics.jsonl").read_text().splitlines()]
    return {"first": first["step_time_s"], "steps": [m["step_time_s"] for m in metrics if "step_time_s" in m]}


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} s ({min(values):.3f}-{max(values):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--settle", type=int, default=5, help="steps after the first left out of the steady step")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--mode", default="default")
    parser.add_argument("--warm-cache", action="store_true")
    args = parser.parse_args()
    if args.steps <= args.settle + 1:
        parser.error("--steps must be larger than --settle + 1")
    rows: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    with tempfile.TemporaryDirectory(prefix="elastic-ddp-compile-") as tmp:
        shared_cache = Path(tmp) / "inductor-cache"
        for round_ in range(args.rounds):
            for compiled in ((False, True) if round_ % 2 == 0 else (True, False)):
                workdir = Path(tmp) / f"round-{round_}"
                cache = shared_cache if args.warm_cache else Path(tmp) / f"cache-{round_}"
                found = launch(workdir, args.steps, args.nproc, compiled, args.mode, cache if compiled else None)
                steady = statistics.median(found["steps"][1 + args.settle:])
                rows[compiled].append({"first": found["first"], "steady": steady})
                print(f"round {round_} {'compiled' if compiled else 'eager   '}: first step {found['first']:.3f} s, "
                      f"steady step {steady:.4f} s", flush=True)
    for compiled, name in ((False, "eager"), (True, f"compiled ({args.mode}, {'warm' if args.warm_cache else 'cold'} cache)")):
        print(f"{name}: first step {spread([r['first'] for r in rows[compiled]])}, "
              f"steady step {spread([r['steady'] for r in rows[compiled]])}")
    ratios = [c["steady"] / e["steady"] for c, e in zip(rows[True], rows[False], strict=True)]
    print(f"steady step compiled/eager: {statistics.median(ratios):.3f}x ({min(ratios):.3f}-{max(ratios):.3f}) "
          f"over {args.rounds} rounds, {args.nproc} ranks")


if __name__ == "__main__":
    main()

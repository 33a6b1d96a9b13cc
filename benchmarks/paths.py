"""The two doors side by side: the trainer path and the library path through the same chaos scenarios.

How to run:
  .venv/bin/python benchmarks/paths.py [--repeats 3] [--scenarios kill-worker,spot-day:1] [--workdir DIR]

``NAME:N`` runs that scenario N times instead of ``--repeats``.

For each scenario, each repeat runs it twice in a row, in alternating order: once training the scenario's own
script (``examples/train.py``, the trainer path) and once training ``examples/byo_loop/train.py`` (the library
path, a hand-written loop on ``elastic_ddp.loop.Runtime``) on the same cluster, faults and verifier. Prints, per
path: whether the verifier passed, when the job noticed each kill -9 and the survivors' first step after it
(seconds after the kill), the
steps redone, and the goodput after start-up; medians with the range over repeats, and the library path's
ratio to the trainer path's. Exit status 1 if any run failed its verifier.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from chaos.report import build_report  # noqa: E402
from chaos.runner import RunOptions, run_scenario  # noqa: E402
from chaos.scenario import load_scenario, with_script  # noqa: E402
from chaos.verify import run_checks  # noqa: E402

LIBRARY = "examples/byo_loop/train.py"
LIBRARY_ARGS = ["--hidden", "512", "--batch-size", "256"]
"""The library path's job sized as the scenarios' trainer-path job (hidden 512, a global batch of 256), so that
a fault's stall is the same share of the run on both paths."""
PATHS = ("trainer", "library")


def run_once(name: str, path: str, workdir: Path, cache: Path) -> dict[str, Any]:
    scenario = load_scenario(name)
    if path == "library":
        scenario = with_script(scenario, LIBRARY, LIBRARY_ARGS)
    facts = run_scenario(scenario, RunOptions(workdir=workdir, cache_dir=cache, progress=None))
    checks = run_checks(facts)
    report = build_report(scenario, facts, checks)
    failed = [f"{check['name']}: {check['message']}" for check in report["checks"] if not check["passed"]]
    kills = [fault for fault in report["faults"] if fault["kind"] in ("kill-worker", "kill-node")]
    return {"passed": report["passed"], "failed": failed, "goodput_after_startup": report["goodput_after_startup"],
            "detect_s": [fault["detect_s"] for fault in kills if fault["detect_s"] is not None],
            "first_step_s": [fault["first_step_s"] for fault in kills if fault["first_step_s"] is not None],
            "steps_redone": [fault["steps_redone"] for fault in kills if fault["steps_redone"] is not None]}


def spread(values: list[float], unit: str = "", digits: int = 2) -> str:
    if not values:
        return "-"
    median = statistics.median(values)
    text = f"{median:.{digits}f}{unit}"
    return text if len(values) == 1 else f"{text} ({min(values):.{digits}f}–{max(values):.{digits}f})"


def ratio(library: list[float], trainer: list[float]) -> str:
    if not library or not trainer or statistics.median(trainer) == 0:
        return "-"
    return f"{statistics.median(library) / statistics.median(trainer):.2f}×"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scenarios", default="kill-worker,spot-day:1")
    parser.add_argument("--workdir", default="", help="keep the runs here (default: a temporary directory)")
    args = parser.parse_args(argv)
    wanted = [item.strip().partition(":") for item in args.scenarios.split(",") if item.strip()]
    repeats = {name: int(count) if count else args.repeats for name, _, count in wanted}
    names = list(repeats)
    results: dict[tuple[str, str], list[dict[str, Any]]] = {(name, path): [] for name in names for path in PATHS}
    with tempfile.TemporaryDirectory(prefix="paths-") as temporary:
        root = Path(args.workdir or temporary)
        for name in names:
            for repeat in range(repeats[name]):
                order = PATHS if repeat % 2 == 0 else PATHS[::-1]
                for path in order:
                    started = time.monotonic()
                    result = run_once(name, path, root / f"{name}-{path}-{repeat}", root / "cache")
                    results[(name, path)].append(result)
                    print(f"{name} {path} #{repeat}: {'passed' if result['passed'] else 'FAILED ' + '; '.join(result['failed'])}"
                          f" in {time.monotonic() - started:.0f} s; first step {result['first_step_s']} s, redone "
                          f"{result['steps_redone']}, goodput after start-up {result['goodput_after_startup']:.3f}",
                          file=sys.stderr, flush=True)
    counts = ", ".join(f"{name} x{count}" for name, count in repeats.items())
    print(f"\n{counts} per path, {time.strftime('%Y-%m-%d')}; medians (min–max); library / trainer\n")
    print("| scenario | measure | trainer path | library path | ratio |")
    print("|---|---|---|---|---|")
    all_passed = True
    for name in names:
        trainer, library = results[(name, "trainer")], results[(name, "library")]
        all_passed &= all(run["passed"] for run in trainer + library)

        def gather(runs: list[dict[str, Any]], key: str) -> list[float]:
            return [float(value) for run in runs for value in (run[key] if isinstance(run[key], list) else [run[key]])]

        print(f"| {name} | verifier passed | {sum(r['passed'] for r in trainer)}/{len(trainer)} | "
              f"{sum(r['passed'] for r in library)}/{len(library)} | |")
        for key, label, unit, digits in (("detect_s", "kill -9 → the job noticed", " s", 2),
                                         ("first_step_s", "kill -9 → first step", " s", 2),
                                         ("steps_redone", "steps redone", "", 0),
                                         ("goodput_after_startup", "goodput after start-up", "", 3)):
            values = gather(trainer, key), gather(library, key)
            if any(values):
                print(f"| {name} | {label} | {spread(values[0], unit, digits)} | {spread(values[1], unit, digits)} | "
                      f"{ratio(values[1], values[0])} |")
    return 0 if all_passed else 1


if __name__ == "__main__":
    sys.exit(main())

"""The two doors side by side: the trainer path and the library path through the same chaos scenarios.

How to run:
  .venv/bin/python benchmarks/paths.py [--repeats 3] [--scenarios kill-worker,spot-day:1] [--workdir DIR]
      [--modes restart,in-process]

``NAME:N`` runs that scenario N times instead of ``--repeats``. ``--modes``: each run once per mode too, the
restart path (workers restarted on every membership change) and the etcd-v3 handler's in-process mode
(``chaos run --in-process``); the table then has a column per path and mode.

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
from chaos.scenario import in_process, load_scenario, with_script  # noqa: E402
from chaos.verify import run_checks  # noqa: E402

LIBRARY = "examples/byo_loop/train.py"
LIBRARY_ARGS = ["--hidden", "512", "--batch-size", "256"]
"""The library path's job sized as the scenarios' trainer-path job (hidden 512, a global batch of 256), so that
a fault's stall is the same share of the run on both paths."""
PATHS = ("trainer", "library")
MODES = ("restart", "in-process")


def run_once(name: str, path: str, workdir: Path, cache: Path, mode: str = "restart") -> dict[str, Any]:
    scenario = load_scenario(name)
    if mode == "in-process":
        scenario = in_process(scenario)
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
    parser.add_argument("--modes", default="restart", help="restart, in-process or both (comma-separated)")
    args = parser.parse_args(argv)
    wanted = [item.strip().partition(":") for item in args.scenarios.split(",") if item.strip()]
    repeats = {name: int(count) if count else args.repeats for name, _, count in wanted}
    modes = [mode.strip() for mode in args.modes.split(",") if mode.strip()]
    if not modes or any(mode not in MODES for mode in modes):
        parser.error(f"--modes {args.modes!r}: expected one or more of {', '.join(MODES)}")
    names = list(repeats)
    columns = [(path, mode) for mode in modes for path in PATHS]
    results: dict[tuple[str, str, str], list[dict[str, Any]]] = {
        (name, path, mode): [] for name in names for path, mode in columns}
    with tempfile.TemporaryDirectory(prefix="paths-") as temporary:
        root = Path(args.workdir or temporary)
        for name in names:
            for repeat in range(repeats[name]):
                order = columns if repeat % 2 == 0 else columns[::-1]
                for path, mode in order:
                    started = time.monotonic()
                    result = run_once(name, path, root / f"{name}-{path}-{mode}-{repeat}", root / "cache", mode)
                    results[(name, path, mode)].append(result)
                    print(f"{name} {path} {mode} #{repeat}: "
                          f"{'passed' if result['passed'] else 'FAILED ' + '; '.join(result['failed'])}"
                          f" in {time.monotonic() - started:.0f} s; first step {result['first_step_s']} s, redone "
                          f"{result['steps_redone']}, goodput after start-up {result['goodput_after_startup']:.3f}",
                          file=sys.stderr, flush=True)
    counts = ", ".join(f"{name} x{count}" for name, count in repeats.items())
    print(f"\n{counts} per column, {time.strftime('%Y-%m-%d')}; medians (min–max); ratio: library / trainer "
          f"({modes[0]})\n")
    print("| scenario | measure | " + " | ".join(f"{path} path, {mode}" for path, mode in columns) + " | ratio |")
    print("|---|---|" + "---|" * len(columns) + "---|")
    all_passed = True
    for name in names:
        runs = [results[(name, path, mode)] for path, mode in columns]
        all_passed &= all(run["passed"] for column in runs for run in column)

        def gather(column: list[dict[str, Any]], key: str) -> list[float]:
            return [float(value) for run in column for value in (run[key] if isinstance(run[key], list) else [run[key]])]

        print(f"| {name} | verifier passed | " + " | ".join(f"{sum(r['passed'] for r in column)}/{len(column)}"
                                                         for column in runs) + " | |")
        for key, label, unit, digits in (("detect_s", "kill -9 → the job noticed", " s", 2),
                                         ("first_step_s", "kill -9 → first step", " s", 2),
                                         ("steps_redone", "steps redone", "", 0),
                                         ("goodput_after_startup", "goodput after start-up", "", 3)):
            values = [gather(column, key) for column in runs]
            if any(values):
                print(f"| {name} | {label} | " + " | ".join(spread(column, unit, digits) for column in values)
                      + f" | {ratio(values[1], values[0])} |")
    return 0 if all_passed else 1


if __name__ == "__main__":
    sys.exit(main())

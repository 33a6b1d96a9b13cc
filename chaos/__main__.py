"""``python -m chaos``: run fault scenarios against real elastic_ddp jobs, and launch local elastic jobs.

  python -m chaos list                              the scenario library
  python -m chaos run SCENARIO [--report-dir DIR]   a scenario (a name from the library or a .toml path);
                                                    exit 0 only if every check passed; --script PATH
                                                    [--script-args ARGS] trains another script (the
                                                    library path: examples/byo_loop/train.py);
                                                    --in-process: with the handler's in-process mode
  python -m chaos demo [--report-dir DIR]           the 'demo' scenario (about a minute), then its report
  python -m chaos launch --nodes 2:3 --nproc-per-node 2 [--etcd ENDPOINT] [--nodes-start N] -- SCRIPT ARGS...
                                                    a local elastic job: `elastic-ddp launch` (the
                                                    runtime's launcher, elastic_ddp.launcher)
  python -m chaos clean                             remove the network namespaces (edp-*) of runs whose
                                                    process is gone (a killed harness's leftovers)
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from chaos.scenario import ChaosError, in_process, load_scenario, scenario_names, with_script
from elastic_ddp.errors import ElasticDDPError


def default_cache_dir() -> Path:
    """Where reference runs are kept: ``$XDG_CACHE_HOME/elastic-ddp/chaos`` (``~/.cache/...``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "elastic-ddp" / "chaos"


def cmd_list(args: argparse.Namespace) -> int:
    for name in scenario_names():
        scenario = load_scenario(name)
        print(f"{name:24} {scenario.description}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from chaos.report import build_report, markdown, write_report
    from chaos.runner import RunOptions, run_scenario
    from chaos.verify import run_checks

    scenario = load_scenario(args.scenario)
    if getattr(args, "script", ""):
        scenario = with_script(scenario, args.script, shlex.split(args.script_args))
    if getattr(args, "in_process", False):
        scenario = in_process(scenario)
    report_dir = Path(args.report_dir or f"chaos-reports/{scenario.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    options = RunOptions(workdir=report_dir / "work", cache_dir=Path(args.cache_dir) if args.cache_dir else default_cache_dir())
    print(f"chaos: {scenario.name}: {scenario.description}\n  work and report in {report_dir}", file=sys.stderr)
    facts = run_scenario(scenario, options)
    checks = run_checks(facts)
    report = build_report(scenario, facts, checks)
    files = write_report(report, facts, report_dir)
    print(markdown({**report, "timeline_png": str(files.png) if files.png else None, "timeline_note": files.png_note}))
    print(f"report: {files.json} and {files.markdown}" + (f"; timeline: {files.png}" if files.png else ""))
    return 0 if report["passed"] else 1


def cmd_demo(args: argparse.Namespace) -> int:
    args.scenario = "demo"
    return cmd_run(args)


def cmd_clean(args: argparse.Namespace) -> int:
    from chaos.netns import clean_orphans, unavailable

    why = unavailable()
    if why:
        print(f"chaos clean: nothing to do: {why}", file=sys.stderr)
        return 0
    for namespace in clean_orphans():
        print(f"removed {namespace}")
    return 0


def cmd_launch(argv: Sequence[str]) -> int:
    """``elastic-ddp launch ARGV``: the launcher speaks, and stops on signals, as itself."""
    from elastic_ddp.launcher import main as launch_main

    return launch_main(argv)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m chaos", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the runner does (INFO)")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="the scenario library").set_defaults(func=cmd_list)
    run = commands.add_parser("run", help="run a scenario and verify the job lost nothing")
    run.add_argument("scenario", help="a name from `list`, or a path to a .toml file")
    run.add_argument("--script", default="", help="train this script instead of the scenario's (e.g. "
                     "examples/byo_loop/train.py, the library path); it takes the runner's flags (chaos/scenario.py)")
    run.add_argument("--script-args", default="", help="the script's own arguments, one shell-quoted string "
                     "(the scenario's job.args belong to its own script and are dropped with --script)")
    run.add_argument("--in-process", action="store_true", help="with the etcd-v3 handler's in-process mode "
                     "(--rdzv-conf in_process=true): the workers no fault hit must keep their processes")
    demo = commands.add_parser("demo", help="run the demo scenario (etcd, 2 nodes, a killed worker, a preemption)")
    for sub in (run, demo):
        sub.add_argument("--report-dir", default="", help="report and work files (default chaos-reports/NAME-TIME)")
        sub.add_argument("--cache-dir", default="", help=f"reference runs (default {default_cache_dir()})")
    run.set_defaults(func=cmd_run)
    demo.set_defaults(func=cmd_demo)
    commands.add_parser("clean", help="remove network namespaces left by runs whose process is gone").set_defaults(
        func=cmd_clean)
    launch = commands.add_parser("launch", add_help=False, help="a local elastic job of simulated nodes "
                                 "(elastic-ddp launch; python -m chaos launch --help)")
    launch.add_argument("launch_args", nargs=argparse.REMAINDER)  # main() hands these to the launcher
    return parser


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # unwinds through every finally: the nodes and services stop


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["launch"]:
        return cmd_launch(argv[1:])
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGTERM, _terminate)
    try:
        return args.func(args)
    except (ChaosError, ElasticDDPError) as exc:
        print(f"chaos: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("chaos: interrupted; every process it started was stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

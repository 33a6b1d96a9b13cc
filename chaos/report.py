"""A chaos run's report: JSON (every figure), a Markdown summary, and a PNG timeline if matplotlib is there.

:func:`build_report` is pure (facts and checks in, a JSON-ready dict out); :func:`write_report`
writes ``report.json``, ``report.md`` and, when ``matplotlib`` can be imported, ``timeline.png``
(steps per second and world size over time, faults marked, recovery intervals shaded). matplotlib
comes with the ``chaos`` extra (``pip install elastic-ddp[chaos]``; scripts/setup.sh installs it):
without it the report says so and has no PNG.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from chaos.scenario import Scenario
from chaos.verify import Check, RunFacts, all_fault_metrics, attempt_starts, facts_summary, first_step_began, goodput

logger = logging.getLogger(__name__)

NO_MATPLOTLIB = "matplotlib is not installed: no timeline PNG (pip install 'elastic-ddp[chaos]' to get one)"


@dataclass(frozen=True)
class ReportFiles:
    json: Path
    markdown: Path
    png: Path | None
    png_note: str


def build_report(scenario: Scenario, facts: RunFacts, checks: list[Check]) -> dict[str, Any]:
    """Everything measured and checked, as plain data (times in seconds since the run started)."""
    metrics = all_fault_metrics(facts)
    starts = attempt_starts(facts.events)
    began = first_step_began(facts.steps) or facts.ended_at
    return {
        "scenario": scenario.name,
        "description": scenario.description,
        "passed": all(check.passed for check in checks),
        "wall_s": round(facts.ended_at - facts.started_at, 2),
        "goodput": round(goodput(facts.steps, starts, facts.started_at, facts.ended_at), 4),
        "startup_s": round(began - facts.started_at, 2),
        "goodput_after_startup": round(goodput(facts.steps, starts, began, facts.ended_at), 4),
        "goodput_figures": asdict(scenario.goodput),
        "reference": {"world_size": facts.reference.world_size, "wall_s": round(facts.reference.wall_s, 1),
                      "checkpoint": facts.reference.checkpoint_uri},
        **facts_summary(facts),
        "checks": [asdict(check) for check in checks],
        "faults": [_fault_entry(record, figures, facts.started_at) for record, figures in zip(facts.faults, metrics)],
        "nodes": [asdict(node) for node in facts.nodes],
        "weights": asdict(facts.weights) if facts.weights else None,
    }


def _fault_entry(record: Any, figures: Any, origin: float) -> dict[str, Any]:
    return {
        "label": record.label,
        "kind": record.kind,
        "target": record.target,
        "fired_at_s": _rel(record.fired_at, origin),
        "ended_at_s": _rel(record.ended_at, origin),
        "detail": record.detail,
        "skipped": record.skipped,
        **{name: (round(value, 2) if isinstance(value, float) else value) for name, value in asdict(figures).items()},
    }


def _goodput_figures(report: dict[str, Any]) -> list[str]:
    """The scenario's ``[goodput]`` figures next to the run's: ``before`` and ``target``, each whole run
    (after start-up), with whether the target was met."""
    figures = report.get("goodput_figures") or {}
    lines = []

    def pair(whole: float | None, after: float | None) -> str:
        return " ".join(part for part in (
            f"{100 * whole:.1f}%" if whole is not None else "",
            f"({100 * after:.1f}% after start-up)" if after is not None else "") if part)

    if figures.get("before") is not None or figures.get("before_after_startup") is not None:
        note = f", {figures['before_note']}" if figures.get("before_note") else ""
        lines.append(f"goodput before{note}: {pair(figures.get('before'), figures.get('before_after_startup'))}")
    target, target_after = figures.get("target"), figures.get("target_after_startup")
    if target is not None or target_after is not None:
        met = all(goal is None or report[name] >= goal
                  for name, goal in (("goodput", target), ("goodput_after_startup", target_after)))
        lines.append(f"goodput target: at least {pair(target, target_after)}: {'met' if met else 'NOT met'}")
    return [""] + lines if lines else []


def _rel(when: float | None, origin: float) -> float | None:
    return None if when is None else round(when - origin, 2)


def markdown(report: dict[str, Any]) -> str:
    """The summary: verdict, checks, and one row per fault."""
    verdict = "PASSED" if report["passed"] else "FAILED"
    lines = [
        f"# Chaos: {report['scenario']} - {verdict}",
        "",
        report["description"],
        "",
        f"wall {report['wall_s']:.0f} s | goodput {100 * report['goodput']:.1f}% ({100 * report['goodput_after_startup']:.1f}% "
        f"after the {report['startup_s']:.0f} s to the first step) | world sizes "
        f"{', '.join(map(str, report['world_sizes']))} | {report['resumes']} resume(s) | reference at world size "
        f"{report['reference']['world_size']}",
        *_goodput_figures(report),
        "",
        "Times are seconds after the fault: the job noticed it (detect), the torchrun agents completed a "
        "rendezvous round, the new workers formed their process group, and completed their first step; the "
        "longest stall is the longest time without a step until the next fault.",
        "",
        "| check | result | detail |",
        "|---|---|---|",
        *(f"| {check['name']} | {_verdict(check)} | {_cell(check['message'])} |" for check in report["checks"]),
        "",
        "| fault | fired (s) | target | detect (s) | agents rdzv (s) | process group (s) | first step (s) "
        "| longest stall (s) | steps redone | world after | notes |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *(_fault_row(fault) for fault in report["faults"]),
    ]
    if report.get("timeline_png"):
        lines += ["", f"timeline: {report['timeline_png']}"]
    elif report.get("timeline_note"):
        lines += ["", report["timeline_note"]]
    return "\n".join(lines) + "\n"


def _fault_row(fault: dict[str, Any]) -> str:
    notes = fault["skipped"] and f"skipped: {fault['skipped']}" or fault["detail"]
    if fault["overlapped"]:
        notes += " (next fault fired before recovery)"
    cells = [fault["label"], _num(fault["fired_at_s"]), fault["target"] or "-", _num(fault["detect_s"]),
             _num(fault["agents_rendezvous_s"]), _num(fault["rendezvous_s"]), _num(fault["first_step_s"]),
             _num(fault["stall_s"]), _num(fault["steps_redone"]),
             _num(fault["world_size_after"]), _cell(notes)]
    return "| " + " | ".join(str(cell) for cell in cells) + " |"


def _num(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if isinstance(value, float) else str(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def write_report(report: dict[str, Any], facts: RunFacts, directory: Path) -> ReportFiles:
    """Write report.json, report.md and (with matplotlib) timeline.png into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    png, note = timeline_png(report, facts, directory / "timeline.png")
    report = {**report, "timeline_png": str(png) if png else None, "timeline_note": note}
    json_path, md_path = directory / "report.json", directory / "report.md"
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    md_path.write_text(markdown(report))
    return ReportFiles(json_path, md_path, png, note)


def timeline_png(report: dict[str, Any], facts: RunFacts, path: Path) -> tuple[Path | None, str]:
    """Steps/s and world size over time with faults and recovery intervals; (None, why) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return None, NO_MATPLOTLIB
    origin = facts.started_at
    times = [step.time - origin for step in facts.steps]
    figure, (rate_axis, world_axis) = plt.subplots(2, 1, sharex=True, figsize=(11, 5.5), height_ratios=(3, 1))
    rate_axis.plot(*_rate(times), color="tab:blue", linewidth=1, drawstyle="steps-mid")
    rate_axis.set_ylabel("steps/s (1 s bins)")
    world_axis.step(times, [step.world_size for step in facts.steps], where="post", color="tab:green")
    world_axis.set_ylabel("world size")
    world_axis.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    world_axis.set_ylim(0, max((step.world_size for step in facts.steps), default=1) + 0.5)  # whole ranks from 0
    world_axis.set_xlabel("seconds since the first node started")
    for fault in report["faults"]:
        _mark_fault(rate_axis, world_axis, fault)
    rate_axis.set_title(f"{report['scenario']}: goodput {100 * report['goodput']:.1f}%")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path, ""


def _rate(times: list[float]) -> tuple[list[float], list[int]]:
    """Steps completed per 1 s bin."""
    if not times:
        return [], []
    bins = [0] * (int(max(times)) + 1)
    for when in times:
        bins[int(when)] += 1
    return [index + 0.5 for index in range(len(bins))], bins


def _mark_fault(rate_axis: Any, world_axis: Any, fault: dict[str, Any]) -> None:
    start = fault["fired_at_s"]
    if start is None:
        return
    for axis in (rate_axis, world_axis):
        axis.axvline(start, color="tab:red", linewidth=0.8)
        if fault["first_step_s"] is not None:
            axis.axvspan(start, start + fault["first_step_s"], color="tab:red", alpha=0.12)
    rate_axis.annotate(fault["kind"], (start, 1), xycoords=("data", "axes fraction"), rotation=90, fontsize=7,
                       va="top", ha="right", color="tab:red")


def _verdict(check: dict[str, Any]) -> str:
    return "skip" if check.get("skipped") else "pass" if check["passed"] else "FAIL"

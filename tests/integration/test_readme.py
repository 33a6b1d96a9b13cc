"""The README's front door stays true: its two own-model scripts run as shown and resume where they stopped (read
from events.jsonl, never from log text), its code blocks are those files byte for byte, it stays short, and every
relative link in it and in the docs it points to leads to a file and heading that exist."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tests.jobs import AS_A_USER_RUNS_IT, REPO, TORCHRUN, events, run

pytestmark = pytest.mark.integration

README = REPO / "README.md"
SCRIPTS = ["examples/readme/trainer_path.py", "examples/readme/library_path.py"]
DOCS = [README, *(REPO / "docs" / name for name in ("guide.md", "operations.md", "performance.md", "chaos.md"))]
MAX_README_LINES = 300


def marked_block(text: str, path: str) -> str:
    """The fenced block that follows ``<!-- file: PATH -->`` in ``text`` (exactly one such marker)."""
    marker = f"<!-- file: {path} -->\n"
    assert text.count(marker) == 1, f"README.md must mark the block of {path} once with {marker!r}"
    after = text.split(marker, 1)[1]
    assert after.startswith("```python\n"), f"the marker of {path} must be followed by a ```python block"
    body, closed, _ = after[len("```python\n"):].partition("\n```\n")
    assert closed, f"the block of {path} is not closed"
    return body + "\n"


@pytest.mark.parametrize("path", SCRIPTS)
def test_the_readme_shows_each_script_as_it_is(path: str) -> None:
    assert marked_block(README.read_text(), path) == (REPO / path).read_text(), (
        f"README.md's block of {path} differs from the file: copy the file into the block")


def test_the_readme_stays_a_front_door() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; move detail to docs/"


def slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {slug(line.lstrip("#")) for line in text.splitlines() if re.match(r"#{1,6} ", line)}


@pytest.mark.parametrize("doc", DOCS, ids=lambda doc: doc.name)
def test_every_relative_link_leads_to_a_file_and_heading_that_exist(doc: Path) -> None:
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        file, _, anchor = target.partition("#")
        linked = (doc.parent / file).resolve() if file else doc
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading #{anchor} in {linked.relative_to(REPO)}")
    assert not broken, broken


def launch(path: str, max_steps: int, checkpoint_dir: Path, log_dir: Path) -> list[dict[str, Any]]:
    result = run(TORCHRUN + ["--standalone", "--nproc-per-node=2", str(REPO / path), "--max-steps", str(max_steps),
                             "--checkpoint-dir", str(checkpoint_dir), "--checkpoint-every", "4", "--log-dir", str(log_dir)],
                 timeout=240, unset=AS_A_USER_RUNS_IT)
    assert result.returncode == 0, result.output[-4000:]
    warnings = [line for line in result.output.splitlines() if "WARNING" in line or "Warning:" in line]
    assert not warnings, warnings  # a first run asks the user to change nothing
    return events(log_dir)


def exits(records: list[dict[str, Any]]) -> set[tuple[int, str, int]]:
    return {(e["rank"], e["reason"], e["status"]) for e in records if e["event"] == "exit"}


@pytest.mark.parametrize("path", SCRIPTS)
def test_a_readme_script_trains_then_resumes_where_it_stopped(path: str, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    first = launch(path, 8, ckpt, tmp_path / "first")
    assert {e["rank"] for e in first if e["event"] == "started_fresh"} == {0, 1}
    assert exits(first) == {(0, "done", 0), (1, "done", 0)}

    second = launch(path, 12, ckpt, tmp_path / "second")
    for rank in (0, 1):
        mine = [e for e in second if e["rank"] == rank]
        kinds = [e["event"] for e in mine]
        assert "started_fresh" not in kinds, kinds
        assert [e["step"] for e in mine if e["event"] == "resumed"] == [8], mine
        assert [e["step"] for e in mine if e["event"] == "done"] == [12], mine
        assert kinds.index("resumed") < kinds.index("done") < kinds.index("exit") == len(kinds) - 1, kinds
    assert exits(second) == {(0, "done", 0), (1, "done", 0)}
    assert 12 in [e["step"] for e in second if e["event"] == "committed"]

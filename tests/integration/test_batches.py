"""Batches of any shape on the trainer path: the README's script, changed only to give its model dict
inputs, trains under torchrun and resumes bitwise after SIGTERM (what each rank did is read from events)."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.jobs import REPO, TORCHRUN, child_env, done_event, events, run

pytestmark = pytest.mark.integration

README_SCRIPT = REPO / "examples" / "readme" / "trainer_path.py"
STEPS = 300
CHANGES = (  # the dataset's inputs become {"x": points}; the model reads them from the dict
    ("        return self.points[index], self.labels[index], index",
     '        return {"x": self.points[index]}, self.labels[index], index'),
    ("        model=nn.Sequential(nn.Linear(16, m.width), nn.ReLU(), nn.Linear(m.width, m.classes)),",
     "        model=OnX(nn.Sequential(nn.Linear(16, m.width), nn.ReLU(), nn.Linear(m.width, m.classes))),"),
    ("@dataclass(frozen=True, kw_only=True)\nclass ModelConfig:",
     "class OnX(nn.Module):\n    def __init__(self, net: nn.Module) -> None:\n        super().__init__()\n"
     "        self.net = net\n\n    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:\n"
     "        return self.net(batch[\"x\"])\n\n\n@dataclass(frozen=True, kw_only=True)\nclass ModelConfig:"),
)


@pytest.fixture(scope="module")
def script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    text = README_SCRIPT.read_text()
    for old, new in CHANGES:
        assert text.count(old) == 1, f"the README's script changed: {old!r} is not in it once"
        text = text.replace(old, new)
    path = tmp_path_factory.mktemp("dict-inputs") / "trainer_path_dict.py"
    path.write_text(text)
    return path


def command(script: Path, ckpt: Path, logs: Path) -> list[str]:
    return [*TORCHRUN, "--standalone", "--nproc-per-node=2", str(script), "--max-steps", str(STEPS),
            "--checkpoint-dir", str(ckpt), "--checkpoint-every", "50", "--log-dir", str(logs)]


def test_dict_inputs_train_and_resume_bitwise_after_sigterm(script: Path, tmp_path: Path) -> None:
    whole = run(command(script, tmp_path / "whole", tmp_path / "whole-logs"), timeout=240)
    assert whole.returncode == 0, whole.output[-4000:]
    reference = done_event(tmp_path / "whole-logs")
    assert reference["step"] == STEPS

    ckpt, first_logs = tmp_path / "split", tmp_path / "first-logs"
    agent = subprocess.Popen(command(script, ckpt, first_logs), cwd=REPO, env=child_env(), start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (ckpt / "step-00000050" / "manifest.json").exists():
            assert agent.poll() is None and time.monotonic() < deadline, "the first launch did not commit step 50"
            time.sleep(0.01)
        agent.send_signal(signal.SIGTERM)  # what a spot node's shutdown sends torchrun
        agent.wait(timeout=60)  # torchrun's agent itself ends with 1 when signalled; the workers say how they ended
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
    stops = {(e["rank"], e["reason"]) for e in events(first_logs, "exit")}
    assert stops == {(0, "preempted"), (1, "preempted")}, stops
    stopped_at = {e["step"] for e in events(first_logs, "exit")}
    assert len(stopped_at) == 1 and 50 <= stopped_at.pop() < STEPS

    second_logs = tmp_path / "second-logs"
    second = run(command(script, ckpt, second_logs), timeout=240)
    assert second.returncode == 0, second.output[-4000:]
    assert {e["rank"] for e in events(second_logs, "resumed")} == {0, 1}
    resumed = done_event(second_logs)
    assert (resumed["model_digest"], resumed["data_digest"]) == (reference["model_digest"], reference["data_digest"])


def test_the_dict_inputs_example_learns_with_the_default_loss_and_evaluation(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    result = run([*TORCHRUN, "--standalone", "--nproc-per-node=2", str(REPO / "examples" / "dict_inputs" / "train.py"),
                  "--max-steps", "60", "--log-dir", str(logs)], timeout=240)
    assert result.returncode == 0, result.output[-4000:]
    done = done_event(logs)
    assert done["step"] == 60 and done["accuracy"] > 0.5, done  # four topics: chance is 0.25

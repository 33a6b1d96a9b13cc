"""A writer SIGKILLed anywhere in a save never leaves a checkpoint that a restore would load half of.

Each trial forks a writer (tests/fixtures/s3_crash_writer.py) that restores the newest commit,
trains a step or two and saves, and kills it at one point of that save: before any data,
inside a data file's write, before the manifest, after the manifest, or after a random delay.
After every kill a fresh CheckpointManager must restore exactly the last committed step, with
verified checksums and the model the writer committed there.
"""

from __future__ import annotations

import logging
import signal
import time
from pathlib import Path

import pytest

from elastic_ddp.checkpoint import CheckpointManager
from elastic_ddp.state import model_digest
from tests.fixtures.s3 import S3Endpoint
from tests.fixtures.s3_crash_writer import KILL_POINTS, CrashWriter, Trial, make_state
from tests.jobs import child_env

pytestmark = pytest.mark.integration

logger = logging.getLogger(__name__)

# Upper bound of the random kill delay: about one save's duration on a busy 2-core machine,
# so that random kills land before, during and after the save.
RANDOM_DELAY_S = {"local": 0.015, "s3": 0.15}


@pytest.fixture(params=["local", "s3"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str]:
    """(name, checkpoint root URI)."""
    if request.param == "local":
        return "local", str(tmp_path / "ckpt")
    s3: S3Endpoint = request.getfixturevalue("s3_server")
    return "s3", s3.uri


@pytest.mark.parametrize("trials", [pytest.param(10, id="10-trials"), pytest.param(50, marks=pytest.mark.slow, id="50-trials")])
def test_a_writer_killed_anywhere_in_a_save_leaves_the_last_commit_restorable(
    backend: tuple[str, str], trials: int
) -> None:
    name, root = backend
    committed: dict[int, str] = {}
    outcomes: dict[str, int] = {}
    started = time.monotonic()
    writer = CrashWriter(root, child_env())
    try:
        for index in range(trials):
            point = KILL_POINTS[index % len(KILL_POINTS)]
            trial = writer.trial(point, seed=1000 + index, random_delay_s=RANDOM_DELAY_S[name])
            step = check_after_kill(root, trial, committed)
            outcome = "%s->%s" % (point, "new" if step == trial.step else "previous")
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
    finally:
        writer.close()
    logger.info("%s: %d trials in %.1fs: %s", name, trials, time.monotonic() - started, sorted(outcomes.items()))


def check_after_kill(root: str, trial: Trial, committed: dict[int, str]) -> int:
    """Assert what a fresh restore finds after ``trial``'s kill; returns the restored step."""
    assert trial.exit_code == -signal.SIGKILL, trial
    manager = CheckpointManager(root, rank=0, world_size=1, run_id="verify")
    state = make_state(seed=99)
    # restore verifies every file's size and checksum; a partial newer commit would make it fall
    # back to an older step (and un-commit the newer one), which the step assertion catches.
    restored = manager.restore(state, allow_fresh_start=not committed)
    step = restored.step if restored else 0
    assert step in allowed_steps(trial), (trial, step)
    if step == trial.step:
        committed[step] = trial.digest
    if step:
        assert model_digest(state.model.state_dict()) == committed[step], (trial, step)
    return step


def allowed_steps(trial: Trial) -> set[int]:
    """The step a restore must find: the new one once the manifest is written, else the previous one."""
    if trial.point == "after-manifest" or trial.saved:
        return {trial.step}
    if trial.point == "random":  # killed somewhere in the save: the manifest may or may not be written
        return {trial.restored_from, trial.step}
    return {trial.restored_from}

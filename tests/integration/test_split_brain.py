"""Two incarnations of a job commit the same step at the same moment: exactly one manifest wins.

Each writer has its own CheckpointManager (so its own token), its own state and its own
storage client; their manifest writes are released together by a barrier, so the create-only
write (``os.link`` locally, ``If-None-Match: *`` on S3) is what decides. The loser must get a
clear error, and the winner's checkpoint must verify and restore.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from elastic_ddp.checkpoint import CheckpointManager, Manifest
from elastic_ddp.checkpoint.manifest import MANIFEST_NAME, step_dir_name
from elastic_ddp.checkpoint.storage import Storage, open_storage
from elastic_ddp.errors import CheckpointError
from elastic_ddp.state import TrainState, model_digest
from tests.fixtures.s3 import S3Endpoint
from tests.fixtures.s3_crash_writer import advance, make_state

pytestmark = pytest.mark.integration

ROUNDS = 4


class RacingStorage:
    """A storage whose manifest writes wait at a barrier shared with the other writer."""

    def __init__(self, inner: Storage, barrier: threading.Barrier) -> None:
        self.inner = inner
        self.root = inner.root
        self.barrier = barrier

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def create(self, path: str, data: bytes) -> None:
        self.barrier.wait(timeout=30)
        self.inner.create(path, data)


@pytest.fixture(params=["local", "s3"])
def two_clients(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, list[Callable[[], Storage]]]:
    """A checkpoint root and two ways to open it (on S3: two differently configured clients)."""
    if request.param == "local":
        root = str(tmp_path / "ckpt")
        return root, [lambda: open_storage(root), lambda: open_storage(root)]
    s3: S3Endpoint = request.getfixturevalue("s3_server")
    return s3.uri, [lambda: open_storage(s3.uri, {}), lambda: open_storage(s3.uri, s3.options)]


def race(managers: list[CheckpointManager], states: list[TrainState]) -> list[Manifest | BaseException]:
    """Both managers save at once; returns each one's manifest or exception."""
    outcomes: list[Manifest | BaseException] = [RuntimeError("did not finish"), RuntimeError("did not finish")]

    def save(index: int) -> None:
        try:
            outcomes[index] = managers[index].save(states[index])
        except BaseException as exc:  # recorded and asserted on by the test
            outcomes[index] = exc

    threads = [threading.Thread(target=save, args=(index,)) for index in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return outcomes


def test_two_writers_racing_for_the_same_step_commit_it_exactly_once(
    two_clients: tuple[str, list[Callable[[], Storage]]]
) -> None:
    root, openers = two_clients
    states = [make_state(seed=1), make_state(seed=2)]
    for step in range(1, ROUNDS + 1):
        barrier = threading.Barrier(2)
        managers = [
            CheckpointManager(root, rank=0, world_size=1, run_id="incarnation-%d" % index, generation=index,
                              storage=RacingStorage(opener(), barrier))
            for index, opener in enumerate(openers)
        ]
        for state in states:
            advance(state, 1)
        outcomes = race(managers, states)
        winners = [index for index, outcome in enumerate(outcomes) if isinstance(outcome, Manifest)]
        assert len(winners) == 1, outcomes
        winner, loser = winners[0], 1 - winners[0]
        assert isinstance(outcomes[loser], CheckpointError), outcomes[loser]
        assert "already exists" in str(outcomes[loser]) and step_dir_name(step) in str(outcomes[loser])
        check_winner_restores(root, step, managers[winner].token, model_digest(states[winner].model.state_dict()))


def check_winner_restores(root: str, step: int, token: str, digest: str) -> None:
    """The committed manifest is the winner's, verifies, and restores the winner's model."""
    reader = CheckpointManager(root, rank=0, world_size=1, run_id="reader")
    info = reader.describe(step)
    assert info.manifest is not None and info.manifest.token == token, info
    reader.verify(info)
    state = make_state(seed=99)
    restored = reader.restore(state)
    assert restored is not None and restored.step == step
    assert model_digest(state.model.state_dict()) == digest
    assert reader.storage.exists(reader.storage.join(step_dir_name(step), MANIFEST_NAME))

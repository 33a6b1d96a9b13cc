"""``python -m chaos launch``: ``elastic-ddp launch`` (:mod:`elastic_ddp.launcher`), the runtime's launcher.

The launcher lives in the runtime; chaos keeps this command for its users, with the launcher's refusals as
:class:`~chaos.scenario.ScenarioError`, the chaos package's own.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path

from chaos.scenario import ScenarioError
from elastic_ddp.launcher import command as _launcher
from elastic_ddp.launcher.command import ETCD_CONF, RDZV_CONF, add_arguments  # noqa: F401 - the chaos names


def node_range(text: str) -> tuple[int, int]:
    """(min, max) of ``--nodes``; ScenarioError naming the value when it is not MIN:MAX or N."""
    try:
        return _launcher.node_range(text)
    except _launcher.LaunchError as exc:
        raise ScenarioError(str(exc)) from None


def launch(args: argparse.Namespace) -> int:
    """Start the nodes, wait for them, return 0 if every one exited 0 (see :func:`elastic_ddp.launcher.launch`)."""
    try:
        return _launcher.launch(args)
    except _launcher.LaunchError as exc:
        raise ScenarioError(str(exc)) from None


def _hold(workdir: Path, stack: ExitStack) -> None:
    try:
        _launcher._hold(workdir, stack)
    except _launcher.LaunchError as exc:
        raise ScenarioError(str(exc)) from None


def main(argv: Sequence[str] | None = None) -> int:
    return _launcher.main(argv)

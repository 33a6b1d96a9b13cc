"""The other libraries' private names elastic_ddp relies on, pinned, and the one-line error when one changes.

A torch or s3fs upgrade that moves any of them fails here first, naming the name: the signatures
below are the installed ones, written out. The compat modules check the same names (parameter names
only) when they are imported; the tests at the end run that check against stub modules.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import operator
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import s3fs
import torch
from packaging import requirements as pep508
from torch.distributed.elastic import events
from torch.distributed.elastic.agent.server import api as agent_api
from torch.distributed.elastic.events import handlers as event_handlers
from torch.distributed.elastic.utils import store as store_util

from elastic_ddp import _torch_compat
from elastic_ddp import checkpoint as checkpoint_package
from elastic_ddp._compat import Behaviour, IncompatibleLibraryError, Private, Requirement, check, release_of, warn_if_untested
from elastic_ddp.checkpoint import _s3fs_compat
from elastic_ddp.checkpoint.storage import open_storage
from elastic_ddp.errors import CheckpointError, ElasticDDPError
from elastic_ddp.prefork import PRELOAD
from elastic_ddp.rendezvous import _torch_compat as rdzv_torch_compat
from elastic_ddp.rendezvous.store import EXIT_BARRIER_COUNT, EXIT_BARRIER_DONE, EXIT_BARRIER_PREFIX

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"

SIGNATURES = {
    (s3fs, "S3FileSystem._call_s3"): "(self, method, *akwarglist, **kwargs)",
}
"""What elastic_ddp calls or overrides, as the supported releases define it (annotations left out).
Of s3fs's ``_pipe_file`` only the ``mode`` parameter matters: ``_s3fs_compat`` checks that."""

REQUIRED = {
    "_torch_compat.REQUIRED": (_torch_compat.REQUIRED, torch),
    "rendezvous._torch_compat.REQUIRED_IN_STORE_UTIL": (rdzv_torch_compat.REQUIRED_IN_STORE_UTIL, store_util),
    "checkpoint._s3fs_compat.REQUIRED": (_s3fs_compat.REQUIRED, s3fs),
}


def _without_annotations(function: Any) -> str:
    signature = inspect.signature(function)
    parameters = [parameter.replace(annotation=inspect.Parameter.empty) for parameter in signature.parameters.values()]
    return str(signature.replace(parameters=parameters, return_annotation=inspect.Signature.empty))


@pytest.mark.parametrize(("module", "name"), list(SIGNATURES), ids=[name for _, name in SIGNATURES])
def test_private_signatures_are_the_ones_elastic_ddp_was_written_against(module: ModuleType, name: str) -> None:
    assert _without_annotations(operator.attrgetter(name)(module)) == SIGNATURES[module, name]


@pytest.mark.parametrize(("requirements", "module"), list(REQUIRED.values()), ids=list(REQUIRED))
def test_every_name_a_compat_module_checks_is_there(requirements: tuple[Requirement, ...], module: ModuleType) -> None:
    assert [problem for required in requirements for problem in required.problems(module)] == []


def _private_torch_names(source: str) -> list[str]:
    """Every name of torch's that starts with ``_`` which ``source`` imports or reads as an attribute."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            found += [f"{node.module}.{alias.name}" for alias in node.names if alias.name.startswith("_")]
            found += [node.module for part in (node.module or "").split(".") if part.startswith("_")]
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names
                      if alias.name.split(".")[0] == "torch" and any(part.startswith("_") for part in alias.name.split("."))]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in {"torch", "dist", "dynamic_rendezvous", "store_util"}:
                found.append(ast.unparse(node))
    return found


def test_the_rendezvous_package_names_no_private_torch_name_outside_its_compat_module() -> None:
    """The handler is on torch's public contract; the exit barrier's keys alone come through the compat module."""
    package = Path(rdzv_torch_compat.__file__).parent
    found = {path.name: names for path in sorted(package.glob("*.py")) if path.name != "_torch_compat.py"
             if (names := _private_torch_names(path.read_text()))}
    assert found == {}
    assert _private_torch_names("from torch.distributed.elastic.rendezvous import dynamic_rendezvous as d\n"
                                "from torch.distributed.elastic.utils.store import _NUM_MEMBERS\n"
                                "import torch._dynamo\nx = dist._get_default_group()\n") == [
        "torch.distributed.elastic.utils.store._NUM_MEMBERS", "torch._dynamo", "dist._get_default_group"]


def test_the_rendezvous_compat_module_exports_torchs_own_objects() -> None:
    assert rdzv_torch_compat._NUM_MEMBERS is store_util._NUM_MEMBERS
    assert rdzv_torch_compat._LAST_MEMBER_CHECKIN is store_util._LAST_MEMBER_CHECKIN


def test_exit_barrier_keys_are_torchs() -> None:
    """The prefix is restated in store.py: torch's agent module cannot be imported from the rendezvous package."""
    assert EXIT_BARRIER_PREFIX == agent_api._TERMINAL_STATE_SYNC_ID
    assert EXIT_BARRIER_COUNT == agent_api._TERMINAL_STATE_SYNC_ID + store_util._NUM_MEMBERS
    assert EXIT_BARRIER_DONE == agent_api._TERMINAL_STATE_SYNC_ID + store_util._LAST_MEMBER_CHECKIN


def test_private_names_the_tests_use_are_there() -> None:
    """tests/unit/test_rendezvous_rounds.py collects torch's rendezvous events through these."""
    assert isinstance(event_handlers._log_handlers, dict)
    assert isinstance(events._events_loggers, dict)


def test_prefork_preloads_modules_that_exist() -> None:
    """prefork imports torch._dynamo (private) ahead of the fork; a missing one would disable preforking."""
    assert [name for name in PRELOAD if importlib.util.find_spec(name) is None] == []


def _declared(*, extra: str | None = None) -> dict[str, pep508.Requirement]:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    lines = project["dependencies"] if extra is None else project["optional-dependencies"][extra]
    return {requirement.name: requirement for requirement in map(pep508.Requirement, lines)}


def test_supported_ranges_are_the_declared_ones() -> None:
    """The range an incompatible library's error names is the one pip enforces."""
    assert _declared()["torch"] == pep508.Requirement(_torch_compat.SUPPORTED)
    assert _declared(extra="s3")["s3fs"] == _declared(extra="test")["s3fs"] == pep508.Requirement(_s3fs_compat.SUPPORTED)


def test_the_installed_versions_are_supported() -> None:
    """What this run tests is inside the declared range (CI installs the torch that scripts/setup.sh names)."""
    assert pep508.Requirement(_torch_compat.SUPPORTED).specifier.contains(torch.__version__)
    assert release_of(torch.__version__) in _torch_compat.TESTED
    assert pep508.Requirement(_s3fs_compat.SUPPORTED).specifier.contains(s3fs.__version__)


def test_the_tested_releases_are_the_supported_range() -> None:
    """Every release CI tests is inside the declared range, and the range holds no other minor release."""
    specifier = pep508.Requirement(_torch_compat.SUPPORTED).specifier
    tested = _torch_compat.TESTED
    assert all(specifier.contains("%d.%d.0" % release) for release in tested)
    (major, first), (_, last) = tested[0], tested[-1]
    assert [minor for minor in range(first, last + 1) if (major, minor) not in tested] == []
    assert not specifier.contains("%d.%d.0" % (major, first - 1)) and not specifier.contains("%d.%d.0" % (major, last + 1))


@pytest.mark.parametrize(("version", "logged"), [("2.13.0+cpu", False), ("2.14.1", False), ("2.14.1+cu130", False),
                                                 ("2.15.0", True), ("2.12.1", True), ("nightly", True)])
def test_a_release_outside_the_tested_ones_gets_one_line(caplog: pytest.LogCaptureFixture, version: str,
                                                          logged: bool) -> None:
    with caplog.at_level("WARNING", logger="elastic_ddp._compat"):
        assert warn_if_untested(version, tested=((2, 13), (2, 14)), supported="torch>=2.13,<2.15") is logged
    lines = [record.getMessage() for record in caplog.records]
    if logged:
        assert lines == [f"elastic_ddp is tested with torch 2.13, 2.14 (torch>=2.13,<2.15); the installed torch {version} "
                         "is not among them"]
    else:
        assert lines == []


# ---------------------------------------------------------------------------
# The check itself, on stub modules


def _stub(module: ModuleType, *, without: str = "", **replaced: Any) -> ModuleType:
    """A module of the same name holding the same objects, less ``without``, some ``replaced``."""
    stub = ModuleType(module.__name__)
    stub.__dict__.update({name: value for name, value in vars(module).items() if name != without})
    stub.__dict__.update(replaced)
    return stub


def _failure(module: ModuleType, requirements: Any, version: str = "9.9.9") -> str:
    with pytest.raises(IncompatibleLibraryError) as info:
        check({module: requirements}, version=version, supported="torch>=2.13,<2.14")
    assert isinstance(info.value, ImportError) and isinstance(info.value, ElasticDDPError)
    message = str(info.value)
    assert "\n" not in message
    return message


def _library(**replaced: Any) -> ModuleType:
    """A stand-in for a torch module: a private class, and a class with a method and an annotated attribute."""

    class Executor:
        closed: bool

        def run(self, handler: Any, deadline: float, update_deadline: Any = None) -> None:
            pass

    module = ModuleType("torch.distributed.example")
    module.__dict__.update(_Op=type("_Op", (), {}), Executor=Executor)
    module.__dict__.update(replaced)
    return module


EXAMPLE = (
    Private(name="_Op", used_in="the example's operations"),
    Private(name="Executor.run", parameters=("self", "handler", "deadline", "update_deadline"), used_in="runs them"),
    Private(name="Executor", attributes=("closed",), used_in="reads closed"),
)


def test_a_missing_name_is_one_line_naming_the_version_the_name_and_the_range() -> None:
    assert _failure(_stub(_library(), without="_Op"), EXAMPLE) == (
        "elastic_ddp supports torch>=2.13,<2.14, and the installed torch 9.9.9 lacks what it relies on: "
        "torch.distributed.example._Op is missing. "
        "Install a supported version: pip install 'torch>=2.13,<2.14'"
    )


def test_every_problem_is_in_the_one_message() -> None:
    class Executor:
        closed: bool

        def run(self, handler: Any, deadline: float) -> None:  # update_deadline gone
            pass

    message = _failure(_stub(_library(Executor=Executor), without="_Op"), EXAMPLE)
    assert "torch.distributed.example._Op is missing" in message
    assert "Executor.run takes (self, handler, deadline), not (self, handler, deadline, update_deadline)" in message


def test_problems_in_several_modules_of_one_library_are_in_one_message() -> None:
    stubs = {
        _stub(_library(), without="_Op"): EXAMPLE,
        _stub(store_util, without="_LAST_MEMBER_CHECKIN"): rdzv_torch_compat.REQUIRED_IN_STORE_UTIL,
    }
    with pytest.raises(IncompatibleLibraryError) as info:
        check(stubs, version="9.9.9", supported="torch>=2.13,<2.14")
    message = str(info.value)
    assert "example._Op is missing; torch.distributed.elastic.utils.store._LAST_MEMBER_CHECKIN is missing" in message


def test_a_missing_attribute_is_named() -> None:
    class Executor:
        def run(self, handler: Any, deadline: float, update_deadline: Any = None) -> None:
            pass

    assert "Executor.closed is missing" in _failure(_library(Executor=Executor), EXAMPLE)


def test_a_behaviour_whose_probe_finds_nothing_does_not_hold() -> None:
    behaviour = Behaviour(description="it flies", used_in="nowhere", holds=lambda module: module.wings)
    assert "torch fails a requirement: it flies" in _failure(ModuleType("torch"), [behaviour])


def test_a_builtin_without_signature_is_reported_not_crashed_on() -> None:
    private = Private(name="_foreach_div_", parameters=("self", "other"), used_in="nowhere")
    assert "torch._foreach_div_ takes (?)" in _failure(torch, [private])


@pytest.mark.parametrize(
    ("compat", "module", "name"),
    [
        ("elastic_ddp._torch_compat", torch, "_foreach_div_"),
        ("elastic_ddp.rendezvous._torch_compat", store_util, "_NUM_MEMBERS"),
        ("elastic_ddp.checkpoint._s3fs_compat", s3fs.S3FileSystem, "_call_s3"),
    ],
)
def test_importing_a_compat_module_runs_the_check(
    monkeypatch: pytest.MonkeyPatch, compat: str, module: Any, name: str
) -> None:
    monkeypatch.delattr(module, name)
    monkeypatch.delitem(sys.modules, compat)
    with pytest.raises(IncompatibleLibraryError, match=f"{name} is missing"):
        importlib.import_module(compat)


def test_s3_storage_reports_an_incompatible_s3fs_as_a_checkpoint_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Opening an s3:// root checks s3fs before anything is sent; the storage contract's error names the root."""

    async def pipe_file_without_mode(self: Any, path: str, data: bytes, **kwargs: Any) -> None:
        pass

    monkeypatch.setattr(s3fs.S3FileSystem, "_pipe_file", pipe_file_without_mode)
    monkeypatch.delitem(sys.modules, "elastic_ddp.checkpoint._s3fs_compat")
    monkeypatch.delattr(checkpoint_package, "_s3fs_compat")
    with pytest.raises(CheckpointError, match=r"^cannot open s3://bucket/run: elastic_ddp supports s3fs>=2024\.12") as info:
        open_storage("s3://bucket/run")
    assert "pipe_file(mode='create') is a create-only PUT" in str(info.value)
    assert isinstance(info.value.__cause__, IncompatibleLibraryError)

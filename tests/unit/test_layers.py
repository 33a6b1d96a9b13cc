"""The package's import structure: the layers docs/design.md draws, and no import circle inside a package.

Every import counts, at module level or inside a function, so a circle cannot hide behind a late import.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "elastic_ddp"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The elastic_ddp modules ``path`` imports (``from elastic_ddp.x import y`` names ``elastic_ddp.x.y`` when that
    is a module, else ``elastic_ddp.x``)."""
    return {name for name in _imported_names(path, with_members=True) if name in MODULES}


def _imported_names(path: Path, with_members: bool = False) -> set[str]:
    """Every module name ``path`` imports (and, ``with_members``, each ``from X import y`` as ``X.y`` too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            if with_members:
                found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


MODULES = {_module_name(path) for path in PACKAGE.rglob("*.py")}
GRAPH = {_module_name(path): _imports(path) - {_module_name(path)} for path in PACKAGE.rglob("*.py")}


def _reaches(start: str, within: str) -> set[str]:
    seen: set[str] = set()
    todo = [name for name in GRAPH[start] if name.startswith(within)]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(n for n in GRAPH[name] if n.startswith(within))
    return seen


@pytest.mark.parametrize("package", ["elastic_ddp.checkpoint", "elastic_ddp.resilience", "elastic_ddp.rendezvous"])
def test_no_module_of_a_package_imports_itself_back(package: str) -> None:
    """A package's own ``__init__`` re-exports its modules, so it is left out of the circle search."""
    modules = sorted(name for name in GRAPH if name.startswith(package + ".") and name != package)
    circles = [name for name in modules if name in _reaches(name, package + ".")]
    assert circles == [], f"modules in an import circle: {circles}"


@pytest.mark.parametrize(
    ("layer", "never"),
    [
        ("elastic_ddp", ("chaos", "examples")),
        ("elastic_ddp.checkpoint", ("elastic_ddp.trainer", "elastic_ddp.runtime", "elastic_ddp.entry")),
        ("elastic_ddp.rendezvous", ("elastic_ddp.trainer", "elastic_ddp.checkpoint", "elastic_ddp.runtime")),
        ("elastic_ddp.resilience", ("elastic_ddp.trainer", "elastic_ddp.runtime", "elastic_ddp.checkpoint")),
    ],
)
def test_a_layer_never_imports_what_is_built_on_it(layer: str, never: tuple[str, ...]) -> None:
    offending = {
        path.name: sorted(name for name in _imported_names(path) if name.startswith(never))
        for path in PACKAGE.rglob("*.py") if _module_name(path).startswith(layer)
    }
    assert {name: found for name, found in offending.items() if found} == {}


def test_the_graph_sees_the_package() -> None:
    """The checks above look at real modules (not an empty graph that passes anything)."""
    assert {"elastic_ddp.checkpoint.manager", "elastic_ddp.checkpoint.replica", "elastic_ddp.runtime"} <= set(GRAPH)
    assert "elastic_ddp.checkpoint.files" in GRAPH["elastic_ddp.checkpoint.remote"]



def test_the_public_api_is_one_import_and_every_name_resolves() -> None:
    import elastic_ddp

    missing = [name for name in elastic_ddp.__all__ if not hasattr(elastic_ddp, name)]
    assert missing == []
    for door in (["Built", "TrainConfig", "WeightedLoss", "config_from_args", "run_training"],
                 ["CheckpointConfig", "ElasticSampler", "Runtime", "entrypoint", "open_events"]):
        assert set(door) <= set(elastic_ddp.__all__)


def test_importing_the_package_loads_no_training_runtime() -> None:
    """torchrun's agent imports the package for the etcd-v3 backend: the runtime's names load on first use."""
    import subprocess
    import sys

    code = ("import sys, elastic_ddp; print(sorted(m for m in sys.modules if m.startswith('elastic_ddp.') "
            "or m == 'torch'))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "[]", loaded


def test_the_public_names_are_the_ones_the_package_maps() -> None:
    import elastic_ddp

    assert sorted(elastic_ddp.__all__) == sorted(["__version__", *elastic_ddp._WHERE])

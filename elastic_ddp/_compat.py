"""The check behind every compat module: another library still has what elastic_ddp relies on.

elastic_ddp builds on a few names that their libraries do not promise to keep (torch's dynamic
rendezvous internals, one s3fs coroutine) and on a few behaviours no name shows. Each library
has one compat module through which every other module gets those names:

- ``elastic_ddp/_torch_compat.py``: torch outside the rendezvous, and the torch versions supported;
- ``elastic_ddp/rendezvous/_torch_compat.py``: torch's dynamic rendezvous (imported from the
  rendezvous package only: importing torch's rendezvous package loads the ``etcd-v3`` entry
  point, which imports that package);
- ``elastic_ddp/checkpoint/_s3fs_compat.py``: s3fs, imported only for ``s3://`` checkpoints.

On import each one calls :func:`check` with the list of what it relies on, so a library that
changed fails there, in one line naming the library, its version, everything missing and the
versions elastic_ddp supports, instead of with an ``AttributeError`` in the middle of a
rendezvous or a save. ``tests/unit/test_compat.py`` pins the exact signatures, so an upgrade
fails there first.
"""

from __future__ import annotations

import inspect
import logging
import operator
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from elastic_ddp.errors import ElasticDDPError

logger = logging.getLogger(__name__)


class IncompatibleLibraryError(ElasticDDPError, ImportError):
    """An installed library lacks a name, signature or behaviour that elastic_ddp relies on."""


@dataclass(frozen=True, kw_only=True)
class Private:
    """One name of another library that elastic_ddp relies on but the library does not promise."""

    name: str
    """Dotted path inside the module, e.g. ``_DistributedRendezvousOpExecutor.run``."""
    used_in: str
    """Where elastic_ddp relies on it, and for what."""
    parameters: tuple[str, ...] | None = None
    """The callable's parameter names in order (``self`` and ``*args``/``**kwargs`` included);
    ``None`` when only its presence matters."""
    attributes: tuple[str, ...] = ()
    """Attributes of the class (or of its instances, declared by a class annotation) that are read."""

    def problems(self, module: ModuleType) -> list[str]:
        """What is missing or different in ``module``; empty when nothing is."""
        where = f"{module.__name__}.{self.name}"
        try:
            found = operator.attrgetter(self.name)(module)
        except AttributeError:
            return [f"{where} is missing"]
        problems = [f"{where}.{name} is missing" for name in self.attributes if not _has_attribute(found, name)]
        if self.parameters is not None:
            actual = _parameters(found)
            if actual != self.parameters:
                problems.append(f"{where} takes ({', '.join(actual)}), not ({', '.join(self.parameters)})")
        return problems


@dataclass(frozen=True, kw_only=True)
class Behaviour:
    """Something a library does that elastic_ddp relies on and that no name shows."""

    description: str
    """What must hold, e.g. "rendezvous deadlines are timezone-aware"."""
    used_in: str
    """Where elastic_ddp relies on it, and for what."""
    holds: Callable[[ModuleType], bool]
    """Whether it holds for the module; raising ``AttributeError`` counts as not holding."""

    def problems(self, module: ModuleType) -> list[str]:
        """``[description]`` when it does not hold for ``module``, else empty."""
        try:
            held = self.holds(module)
        except AttributeError:
            held = False
        return [] if held else [f"{module.__name__} fails a requirement: {self.description}"]


Requirement = Private | Behaviour


def check(required: Mapping[ModuleType, Iterable[Requirement]], *, version: str, supported: str) -> None:
    """Raise :class:`IncompatibleLibraryError`, naming every problem, when a module of one library
    misses any of what elastic_ddp relies on in it.

    Args:
        required: for each module of the library, what elastic_ddp relies on in it.
        version: the installed version of the library, for the message.
        supported: the requirement specifier elastic_ddp declares, e.g. ``torch>=2.13,<2.14``.
    """
    problems = [problem for module, requirements in required.items() for requirement in requirements
                for problem in requirement.problems(module)]  # fmt: skip
    if problems:
        library = next(iter(required)).__name__.partition(".")[0]
        raise IncompatibleLibraryError(
            f"elastic_ddp supports {supported}, and the installed {library} {version} lacks what it relies on: "
            f"{'; '.join(problems)}. Install a supported version: pip install '{supported}'"
        )


def release_of(version: str) -> tuple[int, int] | None:
    """The ``(major, minor)`` release of a version string (``2.14.1+cu130`` is ``(2, 14)``); ``None`` if unreadable."""
    found = re.match(r"(\d+)\.(\d+)", version)
    return (int(found[1]), int(found[2])) if found else None


def warn_if_untested(version: str, *, tested: Iterable[tuple[int, int]], supported: str) -> bool:
    """Log one line when a library that has everything elastic_ddp relies on (:func:`check` passed) is a
    release outside the tested ones: it may work, but no run has shown it. Returns whether it logged."""
    tested = tuple(tested)
    if release_of(version) in tested:
        return False
    library = supported.split(">")[0].split("<")[0].split("=")[0].strip()
    names = ", ".join("%d.%d" % release for release in tested)
    logger.warning("elastic_ddp is tested with %s %s (%s); the installed %s %s is not among them",
                   library, names, supported, library, version)
    return True


def _has_attribute(owner: Any, name: str) -> bool:
    if hasattr(owner, name):
        return True
    return isinstance(owner, type) and any(name in inspect.get_annotations(cls) for cls in owner.__mro__)


def _parameters(function: Any) -> tuple[str, ...]:
    try:
        return tuple(inspect.signature(function).parameters)
    except (TypeError, ValueError):  # a builtin without a signature
        return ("?",)

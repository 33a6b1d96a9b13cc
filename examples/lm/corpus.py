"""A byte-level language-modelling corpus that every machine with Python already has: its stdlib.

The ``.py`` files of the running interpreter's standard library (``sysconfig.get_paths()["stdlib"]``)
are read in sorted order of their relative POSIX paths and concatenated, up to a byte budget. Test
suites, IDLE, bundled data tables (``encodings``, ``pydoc_data``), demos, build-specific files
(``_sysconfigdata*``, ``config-*``) and installed packages (``site-packages``) are left out. The
last ``val_fraction`` of the bytes is held out for validation.

Each split is cut into windows of ``context + 1`` bytes that overlap by one byte, so every byte
after the first is a target exactly once: sample ``i`` is ``(bytes[iT : iT+T], bytes[iT+1 : iT+T+1], i)``
as int64 tensors, the third item being the sample id the runtime checks.

The SHA-256 of the bytes used identifies the corpus: another Python version (or a patched
stdlib) gives another digest, which the training script puts in the resume fingerprint.
"""

from __future__ import annotations

import hashlib
import math
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import Dataset

SKIPPED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idlelib", "turtledemo", "encodings", "pydoc_data",
     "ensurepip", "__pycache__", "lib2to3", "venv"}
)
"""Directory names pruned anywhere in the tree (test suites, IDLE, data tables, bundled installers)."""


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: Path | None = None) -> list[tuple[str, Path]]:
    """``(relative POSIX path, path)`` of every corpus file under ``root``, sorted by relative path."""
    root = Path(root) if root is not None else stdlib_root()
    found: list[tuple[str, Path]] = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in SKIPPED_DIRS and not d.startswith("config-")]
        for name in files:
            if name.endswith(".py") and not name.startswith("_sysconfigdata"):
                path = Path(directory, name)
                found.append((path.relative_to(root).as_posix(), path))
    found.sort(key=lambda item: item[0])
    return found


@dataclass(frozen=True)
class Corpus:
    data: bytes
    """The concatenated bytes, exactly ``budget`` long unless the stdlib is smaller."""
    sha256: str
    """SHA-256 of ``data``."""
    files: int
    """How many files (the last possibly cut) went into ``data``."""
    root: str
    """Where the files came from."""


def load_corpus(budget: int, root: Path | None = None) -> Corpus:
    """The first ``budget`` bytes of the concatenated stdlib sources (files joined as they are)."""
    if budget < 1:
        raise ValueError(f"budget must be >= 1 byte, got {budget}")
    root = Path(root) if root is not None else stdlib_root()
    parts: list[bytes] = []
    size = 0
    for _, path in source_files(root):
        if size >= budget:
            break
        content = path.read_bytes()
        if content and not content.endswith(b"\n"):
            content += b"\n"
        content = content[: budget - size]
        parts.append(content)
        size += len(content)
    data = b"".join(parts)
    if not data:
        raise ValueError(f"no Python sources found under {root}")
    return Corpus(data=data, sha256=hashlib.sha256(data).hexdigest(), files=len(parts), root=str(root))


def unigram_entropy(data: bytes | torch.Tensor) -> float:
    """Entropy (nats) of the byte distribution: the loss of the best model that ignores context."""
    buffer = data if isinstance(data, torch.Tensor) else torch.frombuffer(bytearray(data), dtype=torch.uint8)
    counts = torch.bincount(buffer.long(), minlength=256).double()
    probs = counts[counts > 0] / counts.sum()
    return float(-(probs * probs.log()).sum())


class ByteWindows(Dataset):
    """Windows of ``context + 1`` bytes of one split: ``(input[T], target[T], sample_id)``, int64."""

    def __init__(self, data: torch.Tensor, context: int) -> None:
        if data.dtype != torch.uint8 or data.dim() != 1:
            raise ValueError("data must be a 1-D uint8 tensor")
        self.data = data
        self.context = context
        self.count = max(0, (data.numel() - 1) // context)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        if not 0 <= index < self.count:
            raise IndexError(f"window {index} out of range (0..{self.count - 1})")
        start = index * self.context
        chunk = self.data[start : start + self.context + 1].long()
        return chunk[:-1], chunk[1:], index


@dataclass(frozen=True)
class Splits:
    train: ByteWindows
    val: ByteWindows
    corpus: Corpus
    unigram_nats: float
    """Entropy of the training bytes' distribution (nats): the loss a context-free model reaches."""


def make_splits(budget: int, context: int, val_fraction: float, root: Path | None = None) -> Splits:
    """Load the corpus and cut it into training and validation windows."""
    corpus = load_corpus(budget, root)
    buffer = torch.frombuffer(bytearray(corpus.data), dtype=torch.uint8)
    split = len(corpus.data) - math.ceil(len(corpus.data) * val_fraction)
    train, val = buffer[:split].clone(), buffer[split:].clone()
    return Splits(
        train=ByteWindows(train, context),
        val=ByteWindows(val, context),
        corpus=corpus,
        unigram_nats=unigram_entropy(train),
    )

"""Write the LM example's corpus as token shards to any fsspec URI (local, s3://, ...), with their indexes.

    python examples/lm/shards.py s3://bucket/lm-corpus --shard-bytes 262144
    python examples/lm/train.py --data-shards-uri s3://bucket/lm-corpus --loader-num-workers 2 ...

The corpus is examples/lm/corpus.py's (the stdlib's bytes, ``--budget-bytes`` of them); its last
``--val-fraction`` is held out. Each byte is one token (uint8). Layout under the URI::

    train/train-00000.bin ...  train/index.json
    val/val-00000.bin ...      val/index.json

Options for the storage (an S3 endpoint, credentials) come from ``--storage-options`` as JSON, or from the
environment the filesystem reads (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...).
"""

from __future__ import annotations

import argparse
import json
import math
import posixpath
import sys
from typing import Any

import fsspec
from corpus import load_corpus

from elastic_ddp.shards import build_index

PIECE_BYTES = 64 << 10
"""The example's shards are small (the whole corpus is 3 MB): 64 KiB pieces keep a rank's reads near what it needs."""


def write_shards(uri: str, *, budget_bytes: int = 3_000_000, val_fraction: float = 0.05, shard_bytes: int = 256 << 10,
                 storage_options: dict[str, Any] | None = None, piece_bytes: int = PIECE_BYTES,
                 progress: Any = print) -> str:
    """Write the corpus's train and val shards and their indexes under ``uri``; returns the train index's digest."""
    if shard_bytes < 1024:
        raise ValueError(f"shard_bytes must be >= 1024, got {shard_bytes}")
    corpus = load_corpus(budget_bytes)
    split = len(corpus.data) - math.ceil(len(corpus.data) * val_fraction)
    fs, root = fsspec.core.url_to_fs(uri, **(storage_options or {}))
    digest = ""
    for name, data in (("train", corpus.data[:split]), ("val", corpus.data[split:])):
        directory = posixpath.join(root.rstrip("/"), name)
        fs.makedirs(directory, exist_ok=True)
        for stale in fs.glob(posixpath.join(directory, "*")):
            fs.rm(stale)
        for number, start in enumerate(range(0, len(data), shard_bytes)):
            fs.pipe_file(posixpath.join(directory, f"{name}-{number:05d}.bin"), data[start : start + shard_bytes])
        index = build_index(f"{uri.rstrip('/')}/{name}", fs, kind="tokens", dtype="uint8", piece_bytes=piece_bytes)
        progress(f"{uri.rstrip('/')}/{name}: {len(index.shards)} shards, {index.total_bytes:,} tokens, index "
                 f"{index.digest[:16]}")
        digest = digest or index.digest
    return digest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("uri", help="where the shards go: a directory or an object-store prefix")
    parser.add_argument("--budget-bytes", type=int, default=3_000_000, help="corpus bytes (as --data-budget-bytes)")
    parser.add_argument("--val-fraction", type=float, default=0.05, help="held-out fraction (as --data-val-fraction)")
    parser.add_argument("--shard-bytes", type=int, default=256 << 10, help="bytes per shard (default 256 KiB)")
    parser.add_argument("--piece-bytes", type=int, default=PIECE_BYTES,
                        help="the unit a node downloads, caches and verifies (default 64 KiB)")
    parser.add_argument("--storage-options", default="", help="fsspec options as JSON (an S3 endpoint_url, ...)")
    args = parser.parse_args(argv)
    try:
        options = json.loads(args.storage_options) if args.storage_options else {}
        if not isinstance(options, dict):
            raise ValueError("must be a JSON object")
    except ValueError as exc:
        parser.error(f"--storage-options: {exc}")
    try:
        write_shards(args.uri, budget_bytes=args.budget_bytes, val_fraction=args.val_fraction,
                     shard_bytes=args.shard_bytes, storage_options=options, piece_bytes=args.piece_bytes)
    except (OSError, ValueError) as exc:
        print(f"shards.py: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

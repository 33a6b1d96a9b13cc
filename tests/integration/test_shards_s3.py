"""Sharded data on a real S3 endpoint (moto's server on 127.0.0.1, through s3fs): the index and the node cache on
object storage, a shard corrupted in storage, and the LM example trained from token shards with DataLoader
workers, resumed at another world size and another worker count with the same data digest."""

from __future__ import annotations

import json
import multiprocessing
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from chaos.verify import WORLD_CHANGE_ATOL, WORLD_CHANGE_RTOL
from elastic_ddp.shards import ShardIntegrityError, ShardReader, TokenWindows, build_index
from tests.fixtures.s3 import S3Endpoint
from tests.jobs import REPO, TORCHRUN, import_script, inspect, load_model_state, run

pytestmark = pytest.mark.integration

LM_TRAIN = str(REPO / "examples" / "lm" / "train.py")
TINY = ["--model-n-layer", "1", "--model-d-model", "32", "--model-n-head", "2", "--model-context", "32",
        "--global-batch-size", "16", "--optim-warmup-steps", "2", "--optim-decay-steps", "20",
        "--data-eval-batches", "1", "--data-eval-batch-size", "8", "--log-every", "1", "--no-use-amp"]


def _write_tokens(s3: S3Endpoint, name: str, sizes: tuple[int, ...]) -> tuple[str, list[bytes]]:
    fs, uri = s3.filesystem(), s3.child_uri(name)
    rng = np.random.default_rng(7)
    bodies = [rng.integers(0, 60_000, size=size).astype("<u2").tobytes() for size in sizes]
    for number, body in enumerate(bodies):
        fs.pipe_file(f"{uri}/tok-{number:03d}.bin", body)
    build_index(uri, fs, kind="tokens", dtype="uint16", piece_bytes=4096)
    return uri, bodies


def _read_all(uri: str, cache: str, options: dict, out: str) -> None:
    data = TokenWindows(ShardReader(uri, cache_dir=cache, storage_options=options), 32)
    digest = sum(int(data[i][0].sum()) for i in range(len(data)))
    Path(out).write_text(json.dumps({"sum": digest, "fetched": data.reader.cache.stats.fetched}))


def test_token_shards_on_s3_are_read_through_one_node_cache_by_several_processes(s3_server: S3Endpoint, tmp_path: Path) -> None:
    uri, bodies = _write_tokens(s3_server, "tokens", (9000, 5000))
    expected = sum(int(np.frombuffer(body, "<u2")[w * 32 : w * 32 + 32].astype(np.int64).sum())
                   for body in bodies for w in range((len(body) // 2 - 1) // 32))
    context = multiprocessing.get_context("fork")
    outs = [tmp_path / f"out{n}.json" for n in range(3)]
    children = [context.Process(target=_read_all, args=(uri, str(tmp_path / "cache"), s3_server.options, str(out)))
                for out in outs]
    for child in children:
        child.start()
    for child in children:
        child.join(120)
        assert child.exitcode == 0
    results = [json.loads(out.read_text()) for out in outs]
    assert all(result["sum"] == expected for result in results)
    pieces = sum(-(-len(body) // 4096) for body in bodies)
    assert sum(result["fetched"] for result in results) == pieces, "a piece was downloaded twice on one node"


def test_a_shard_corrupted_in_storage_is_never_served(s3_server: S3Endpoint, tmp_path: Path) -> None:
    uri, bodies = _write_tokens(s3_server, "corrupt", (3000,))
    flipped = bytearray(bodies[0])
    flipped[5000] ^= 0xFF  # piece 1 (bytes 4096-8191); same size, so the index's size check passes
    s3_server.filesystem().pipe_file(f"{uri}/tok-000.bin", bytes(flipped))
    data = TokenWindows(ShardReader(uri, cache_dir=str(tmp_path / "cache"), storage_options=s3_server.options), 32)
    assert data[0][0].tolist() == np.frombuffer(bodies[0], "<u2")[:32].astype(np.int64).tolist()  # piece 0 is intact
    with pytest.raises(ShardIntegrityError, match=r"tok-000.bin.000001: its SHA-256 does not match the index"):
        data[80]  # window 80 starts at token 2560, byte 5120: piece 1
    assert not data.reader.cache.cached(data.reader.piece_key(0, 1))


def test_reads_during_an_s3_outage_wait_and_return_the_right_bytes(s3_server: S3Endpoint, tmp_path: Path) -> None:
    from chaos.s3 import StorageProxy

    uri, bodies = _write_tokens(s3_server, "outage", (3000,))
    proxy = StorageProxy(int(s3_server.endpoint.rsplit(":", 1)[1])).start()
    try:
        options = {**s3_server.options, "endpoint_url": proxy.endpoint}
        data = TokenWindows(ShardReader(uri, cache_dir=str(tmp_path / "cache"), storage_options=options), 32)
        data.reader.fs.retries = 1  # s3fs's own retries (5, with backoff) only make each failed attempt slower
        proxy.set_down(True)
        got: list[list[int]] = []
        reader = threading.Thread(target=lambda: got.append(data[50][0].tolist()))
        reader.start()
        _wait(lambda: data.reader.read_retries >= 2)  # the read failed twice and keeps trying
        proxy.set_down(False)
        reader.join(60)
        assert got == [np.frombuffer(bodies[0], "<u2")[1600:1632].astype(np.int64).tolist()]
    finally:
        proxy.close()


def _wait(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        threading.Event().wait(0.02)


def _lm(s3: S3Endpoint, args: list[str], nproc: int, cache: Path) -> None:
    launcher = TORCHRUN + ["--standalone", f"--nproc-per-node={nproc}"] if nproc > 1 else [sys.executable]
    shards = ["--data-shards-uri", s3.child_uri("lm"), "--data-shards-cache-dir", str(cache)]
    result = run(launcher + [LM_TRAIN, *TINY, *shards, *args], timeout=180, env=s3.env)
    assert result.returncode == 0, result.output[-4000:]


@pytest.mark.slow  # CI time: .ci/run runs it in its third part (SLOW_SET)
def test_the_lm_example_trains_from_s3_shards_and_resumes_exactly_at_another_world_size_and_worker_count(
        s3_server: S3Endpoint, tmp_path: Path) -> None:
    shards = import_script(REPO / "examples" / "lm" / "shards.py")
    shards.write_shards(s3_server.child_uri("lm"), budget_bytes=100_000, shard_bytes=8192,
                        storage_options=s3_server.options, piece_bytes=4096, progress=lambda line: None)
    straight, split = tmp_path / "straight", tmp_path / "split"
    common = ["--checkpoint-every", "10"]
    _lm(s3_server, [*common, "--max-steps", "20", "--checkpoint-dir", str(straight), "--loader-num-workers", "2"], 2,
        tmp_path / "cache-a")
    _lm(s3_server, [*common, "--max-steps", "10", "--checkpoint-dir", str(split), "--loader-num-workers", "2"], 2,
        tmp_path / "cache-b")
    # another node: an empty cache, one rank, no loader workers
    _lm(s3_server, [*common, "--max-steps", "20", "--checkpoint-dir", str(split), "--loader-num-workers", "0"], 1,
        tmp_path / "cache-c")
    reference, resumed = inspect(str(straight)), inspect(str(split))
    assert resumed["step"] == reference["step"] == 20
    assert resumed["data_digest"] == reference["data_digest"]
    assert resumed["fingerprint"]["build.shards_index_sha256"] == reference["fingerprint"]["build.shards_index_sha256"]
    ours, theirs = load_model_state(str(split)), load_model_state(str(straight))
    for name, value in theirs.items():
        torch.testing.assert_close(ours[name], value, rtol=WORLD_CHANGE_RTOL, atol=WORLD_CHANGE_ATOL)

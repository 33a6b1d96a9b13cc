"""The ``elastic-ddp`` command.

  elastic-ddp ckpt ls URI                  every step directory: step, time, size, world size, valid?
  elastic-ddp ckpt inspect URI [--json]    the newest valid checkpoint (or URI/step-N): position and digests
  elastic-ddp ckpt verify URI [--step N]   re-hash every file; non-zero exit naming the first bad file
  elastic-ddp ckpt export URI [--step N] --to model.safetensors|model.pt [--force] [--what model|optimizer|all]
                                           the newest committed checkpoint's (or step N's) model as a
                                           plain state_dict file, verified before it is written
  elastic-ddp ckpt rm URI --step N [--dry-run]          delete one step directory
  elastic-ddp ckpt gc URI [--keep K] [--dry-run]        apply retention: keep the newest K committed,
                                                        remove stale unfinished writes

  elastic-ddp shards index URI [--kind tokens|tar] [--dtype uint16] [--pattern GLOB] [--piece-bytes N]
                                           read every shard under URI and write URI/index.json
  elastic-ddp shards verify URI            re-hash every shard against URI/index.json; exit 1 naming
                                           each shard and piece that does not match

  elastic-ddp launch --nodes 2:3 --nproc-per-node 2 [--etcd ENDPOINT] -- SCRIPT ARGS...
                                           a local elastic run on this machine (embedded etcd), its
                                           console showing rank 0's progress, restarts and recoveries
  elastic-ddp demo                         the recovery demo: kill a worker, preempt a node, report
  elastic-ddp doctor [--json] [--rdzv-endpoint HOST:PORT]
                                           network health: store, TCP matrix, all-reduce bus bandwidth,
                                           slow nodes, links and stragglers (run it through torchrun as
                                           `-m elastic_ddp.doctor` on every node; alone: one rank)

URI is a checkpoint root (``--checkpoint-dir`` of a run) or one ``step-N`` directory in it.
``launch`` is the runtime's launcher (:mod:`elastic_ddp.launcher`; this module imports torch only for
the commands that need it, so the launcher never does). ``demo`` runs the ``chaos`` package's demo
scenario (``python -m chaos demo``, started as a program: the runtime never imports chaos).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from elastic_ddp.errors import CheckpointCorruptError, CheckpointError, ConfigError, ElasticDDPError

if TYPE_CHECKING:
    from elastic_ddp.checkpoint import CheckpointInfo, CheckpointManager


def _split_uri(uri: str) -> tuple[str, int | None]:
    """A ``.../step-N`` URI names one checkpoint of the root above it."""
    from elastic_ddp.checkpoint.files import basename
    from elastic_ddp.checkpoint.manifest import parse_step_dir

    step = parse_step_dir(basename(uri))
    if step is None:
        return uri, None
    parent, slash, _ = uri.rstrip("/").rpartition("/")
    return (parent or "/") if slash else ".", step


def _manager(root: str, options: dict[str, Any] | None = None) -> CheckpointManager:
    from elastic_ddp.checkpoint import CheckpointManager

    return CheckpointManager(root, rank=0, world_size=1, run_id="cli", storage_options=options or None)


def _pick(manager: CheckpointManager, step: int | None) -> CheckpointInfo:
    """The requested checkpoint, or the newest one that verifies."""
    if step is not None:
        return manager.describe(step)
    for info in manager.list():
        if info.committed:
            try:
                manager.verify(info)
                return info
            except CheckpointError:
                continue
    raise CheckpointError(f"no valid checkpoint under {manager.uri}")


def cmd_ls(args: argparse.Namespace) -> int:
    root, _ = _split_uri(args.uri)
    manager = _manager(root, args.options)
    infos = manager.list()
    if not infos:
        _require_root(manager)
        print(f"no checkpoints under {root}")
        return 0
    print(f"{'step':>8}  {'created (UTC)':19}  {'size MB':>8}  {'world':>5}  valid")
    for info in infos:
        manifest = info.manifest
        try:
            manager.verify(info)
            verdict = "yes"
        except CheckpointError as exc:
            verdict = f"NO: {exc}"
        if manifest is None:
            print(f"{info.step:>8}  {'-':19}  {'-':>8}  {'-':>5}  {verdict}")
            continue
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(manifest.created_at))
        print(f"{info.step:>8}  {created:19}  {manifest.total_bytes / 1e6:>8.2f}  {manifest.world_size:>5}  {verdict}")
    return 0


def inspect_checkpoint(uri: str, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The facts ``ckpt inspect`` prints, as a dict (also used by tests and the chaos verifier)."""
    from elastic_ddp.checkpoint.manager import deserialize
    from elastic_ddp.state import model_digest

    root, step = _split_uri(uri)
    manager = _manager(root, options)
    info = _pick(manager, step)
    data = manager.verify(info)
    manifest = info.manifest
    assert manifest is not None
    replicated = deserialize(data[manifest.replicated_file], info.path)
    model = replicated.get("model") if isinstance(replicated, dict) else None
    meta = manifest.meta
    return {
        **{name: value for name, value in meta.items() if name not in ("step", "fingerprint")},
        "path": info.path,
        "step": manifest.step,
        "epoch": meta.get("epoch"),
        "cursor": meta.get("cursor"),
        "samples_seen": meta.get("samples_seen"),
        "world_size": manifest.world_size,
        "run_id": manifest.run_id,
        "generation": manifest.generation,
        "created_at": manifest.created_at,
        "torch_version": manifest.torch_version,
        "total_bytes": manifest.total_bytes,
        "files": sorted(manifest.files),
        "fingerprint": meta.get("fingerprint", {}),
        "model_digest": model_digest(model) if isinstance(model, dict) else None,
        "data_digest": manifest.data_digest,
    }


def cmd_inspect(args: argparse.Namespace) -> int:
    facts = inspect_checkpoint(args.uri, args.options)
    if args.json:
        print(json.dumps(facts, indent=2, sort_keys=True))
        return 0
    for key in ("path", "step", "epoch", "cursor", "samples_seen", "world_size", "run_id", "generation",
                "torch_version", "total_bytes", "model_digest", "data_digest"):
        print(f"{key:>14}: {facts[key]}")
    return 0


def _require_root(manager: CheckpointManager) -> None:
    if not manager.storage.exists(manager.storage.root):
        raise CheckpointError(f"{manager.uri} does not exist")


def cmd_verify(args: argparse.Namespace) -> int:
    root, step = _split_uri(args.uri)
    step = args.step if args.step is not None else step
    manager = _manager(root, args.options)
    # every step that has a manifest file: one that does not parse is a failure, not an absence
    infos = [manager.describe(step)] if step is not None else [i for i in manager.list() if i.manifest_present]
    if not infos:
        _require_root(manager)
        print(f"no committed checkpoints under {root}", file=sys.stderr)
        return 1
    failed = 0
    for info in infos:
        try:
            manager.verify(info)
            print(f"ok    {info.path}")
        except CheckpointError as exc:
            failed += 1
            print(f"FAIL  {exc}")
    return 1 if failed else 0


def cmd_export(args: argparse.Namespace) -> int:
    from elastic_ddp.checkpoint import export
    from elastic_ddp.checkpoint.format import flatten
    from elastic_ddp.checkpoint.manager import deserialize

    suffix = export.check_target(args.to, force=args.force)
    root, step = _split_uri(args.uri)
    step = args.step if args.step is not None else step
    manager = _manager(root, args.options)
    info = _committed(manager, step)
    manifest = info.manifest
    assert manifest is not None
    name = manifest.replicated_file
    size = manifest.files[name].size
    if size >= export.PROGRESS_MIN_BYTES:
        print(f"reading and verifying {manager.storage.join(info.path, name)} ({size / 1e6:.0f} MB)", file=sys.stderr)
    replicated = deserialize(manager.read_verified(info, name), info.path)
    part = export.select(replicated, args.what, info.path)
    if suffix == ".safetensors":
        tensors = export.flat_tensors(part, args.what, info.path, instead=args.to.removesuffix(suffix) + ".pt")
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        written = export.write_safetensors(args.to, tensors, export.Progress(f"writing {args.to}", total))
    else:
        total = sum(t.numel() * t.element_size() for t in flatten(part).tensors)
        written = export.write_torch(args.to, part, export.Progress(f"writing {args.to}", total))
    part_name = {"model": "the model's state_dict", "optimizer": "the optimizer's state_dict", "all": "the replicated state"}
    print(f"exported {part_name[args.what]} of {info.path} (step {info.step}) to {args.to} ({written / 1e6:.1f} MB)")
    return 0


def _committed(manager: CheckpointManager, step: int | None) -> CheckpointInfo:
    """Step ``step``'s checkpoint, or the newest committed one; CheckpointError saying which steps there are."""
    infos = manager.list()
    if step is None:
        info = next((info for info in infos if info.committed), None)
        if info is None:
            _require_root(manager)
            raise CheckpointError(f"no committed checkpoint under {manager.uri}")
        return info
    info = next((info for info in infos if info.step == step), None)
    if info is None or not info.manifest_present:
        committed = ", ".join(str(info.step) for info in infos if info.committed) or "none"
        raise CheckpointError(f"no committed checkpoint of step {step} under {manager.uri} (committed steps: {committed})")
    if info.manifest is None:
        raise CheckpointCorruptError(f"{info.path}: {info.problem}")
    return info


def cmd_rm(args: argparse.Namespace) -> int:
    root, step = _split_uri(args.uri)
    step = args.step if args.step is not None else step
    if step is None:
        print("elastic-ddp: error: name the checkpoint with --step N or a .../step-N URI", file=sys.stderr)
        return 2
    manager = _manager(root, args.options)
    if args.dry_run:
        print(f"would remove {manager.existing_step_path(step)}")
        return 0
    print(f"removed {manager.remove_step(step)}")
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    if args.keep < 1:
        print("elastic-ddp: error: --keep must be >= 1", file=sys.stderr)
        return 2
    root, _ = _split_uri(args.uri)
    manager = _manager(root, args.options)
    if args.dry_run:
        doomed = manager.retention_plan(keep=args.keep)
        verb = "would remove"
    else:
        doomed = manager.apply_retention(keep=args.keep)
        verb = "removed"
    for path in doomed:
        print(f"{verb} {path}")
    if not doomed:
        print("nothing to remove")
    return 0


def _shards_fs(uri: str, options: dict[str, Any]) -> Any:
    import fsspec

    try:
        return fsspec.core.url_to_fs(uri, **options)[0]
    except (ImportError, ValueError, TypeError) as exc:
        raise ConfigError(f"cannot open {uri}: {exc}") from exc


def cmd_shards_index(args: argparse.Namespace) -> int:
    from elastic_ddp.shards import build_index

    progress = functools.partial(print, file=sys.stderr, flush=True)
    index = build_index(args.uri, _shards_fs(args.uri, args.options), kind=args.kind, pattern=args.pattern,
                        dtype=args.dtype, piece_bytes=args.piece_bytes, progress=progress)
    unit = "tokens" if index.kind == "tokens" else "samples"
    count = sum(s.tokens for s in index.shards) if index.kind == "tokens" else sum(len(s.samples) for s in index.shards)
    print(f"wrote {args.uri.rstrip('/')}/index.json: {len(index.shards)} shards, {index.total_bytes:,} bytes, "
          f"{count:,} {unit}, index {index.digest[:16]}")
    return 0


def cmd_shards_verify(args: argparse.Namespace) -> int:
    from elastic_ddp.shards import load_index
    from elastic_ddp.shards.index import shard_digests

    fs = _shards_fs(args.uri, args.options)
    index = load_index(args.uri, fs)  # sizes checked here
    root = fs._strip_protocol(args.uri).rstrip("/")
    failed = 0
    for shard in index.shards:
        with fs.open(f"{root}/{shard.name}", "rb") as handle:
            whole, pieces, _ = shard_digests(handle, index.piece_bytes)  # the size was checked on load
        bad = [number for number, (got, expected) in enumerate(zip(pieces, shard.pieces)) if got != expected]
        if bad or whole != shard.sha256:
            failed += 1
            print(f"FAIL  {shard.name}: pieces {', '.join(map(str, bad[:10])) or 'none'}"
                  f"{' …' if len(bad) > 10 else ''} do not match; whole-shard SHA-256 "
                  f"{'matches' if whole == shard.sha256 else 'does not match'}")
        else:
            print(f"ok    {shard.name} ({shard.bytes:,} bytes, {len(shard.pieces)} pieces)")
    print(f"{len(index.shards) - failed} of {len(index.shards)} shards match {args.uri.rstrip('/')}/index.json")
    return 1 if failed else 0


def run_chaos(command: str, args: Sequence[str]) -> int:
    """Replace this process with ``python -m chaos COMMAND ARGS`` (same interpreter, same signals): chaos is run
    as a program, never imported."""
    argv = [sys.executable, "-m", "chaos", command, *args]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, argv)
    return 1  # not reached: execv only returns by raising


def build_parser() -> argparse.ArgumentParser:
    from elastic_ddp.checkpoint import export

    parser = argparse.ArgumentParser(prog="elastic-ddp", description="elastic_ddp tools")
    commands = parser.add_subparsers(dest="command", required=True)
    ckpt = commands.add_parser("ckpt", help="list, inspect, verify and clean up checkpoints")
    options_help = "fsspec options for a remote URI, as for --checkpoint-storage-options (e.g. an S3 endpoint_url)"
    ckpt.add_argument("--storage-options", metavar="JSON", default="", help=options_help)
    options = argparse.ArgumentParser(add_help=False)  # accepted after the subcommand too
    options.add_argument("--storage-options", metavar="JSON", default=argparse.SUPPRESS, help=options_help)
    ckpt_commands = ckpt.add_subparsers(dest="ckpt_command", required=True)
    ckpt_commands.add_parser = functools.partial(ckpt_commands.add_parser, parents=[options])  # type: ignore[method-assign]
    ls = ckpt_commands.add_parser("ls", help="list step directories with time, size, world size and validity")
    ls.add_argument("uri", help="checkpoint root (a path or URI)")
    ls.set_defaults(func=cmd_ls)
    inspect = ckpt_commands.add_parser("inspect", help="show a checkpoint's position and digests")
    inspect.add_argument("uri", help="checkpoint root (newest valid is shown) or a step-N directory")
    inspect.add_argument("--json", action="store_true", help="machine-readable output")
    inspect.set_defaults(func=cmd_inspect)
    verify = ckpt_commands.add_parser("verify", help="re-hash files; exit 1 naming any file that does not match")
    verify.add_argument("uri", help="checkpoint root or a step-N directory")
    verify.add_argument("--step", type=int, help="verify only this step (default: every committed one)")
    verify.set_defaults(func=cmd_verify)
    export_ = ckpt_commands.add_parser(
        "export", help="write a checkpoint's model (or optimizer, or all) as a plain .safetensors or .pt file")
    export_.add_argument("uri", help="checkpoint root (newest committed is exported) or a step-N directory")
    export_.add_argument("--step", type=int, help="export this step (default: the newest committed)")
    export_.add_argument("--to", required=True, metavar="FILE",
                         help="output: FILE.safetensors (safetensors.torch.load_file) or FILE.pt (torch.load(weights_only=True))")
    export_.add_argument("--force", action="store_true", help="replace the output file if it exists")
    export_.add_argument("--what", choices=export.PARTS, default="model",
                         help="model (default): the model's state_dict; optimizer: its state_dict; all: the replicated state")
    export_.set_defaults(func=cmd_export)
    rm = ckpt_commands.add_parser("rm", help="delete one step directory")
    rm.add_argument("uri", help="checkpoint root or a step-N directory")
    rm.add_argument("--step", type=int, help="the step to delete")
    rm.add_argument("--dry-run", action="store_true", help="only say what would be deleted")
    rm.set_defaults(func=cmd_rm)
    gc = ckpt_commands.add_parser("gc", help="keep the newest K committed checkpoints, remove the rest and stale leftovers")
    gc.add_argument("uri", help="checkpoint root")
    gc.add_argument("--keep", type=int, default=3, help="committed checkpoints to keep (default: 3)")
    gc.add_argument("--dry-run", action="store_true", help="only say what would be deleted")
    gc.set_defaults(func=cmd_gc)
    shards = commands.add_parser("shards", help="build and verify the index of a sharded dataset (elastic_ddp.shards)")
    shards.add_argument("--storage-options", metavar="JSON", default="", help=options_help)
    shard_commands = shards.add_subparsers(dest="shards_command", required=True)
    shard_commands.add_parser = functools.partial(shard_commands.add_parser, parents=[options])  # type: ignore[method-assign]
    index = shard_commands.add_parser("index", help="read every shard under URI and write URI/index.json")
    index.add_argument("uri", help="the directory or object-store prefix that holds the shards")
    index.add_argument("--kind", choices=("tokens", "tar"), default="tokens",
                       help="tokens: flat little-endian token shards (default); tar: WebDataset-layout tar shards")
    index.add_argument("--dtype", choices=("uint8", "uint16", "uint32"), default="uint16",
                       help="the tokens' integer type (tokens only; default uint16)")
    index.add_argument("--pattern", default="", help="which files are shards (default: *.bin for tokens, *.tar for tar)")
    index.add_argument("--piece-bytes", type=int, default=4 << 20,
                       help="the unit a node downloads, caches and verifies (default 4 MiB)")
    index.set_defaults(func=cmd_shards_index)
    verify_shards = shard_commands.add_parser("verify", help="re-hash every shard against URI/index.json")
    verify_shards.add_argument("uri", help="the directory or object-store prefix that holds the shards")
    verify_shards.set_defaults(func=cmd_shards_verify)
    launch = commands.add_parser("launch", add_help=False,
                                 help="a local elastic run: --nodes MIN:MAX --nproc-per-node N [--etcd HOST:PORT] -- SCRIPT ARGS")
    launch.set_defaults(func=None)
    demo = commands.add_parser("demo", add_help=False, help="recovery demo: 2 local nodes, a worker killed, a node preempted")
    demo.set_defaults(func=None)
    commands.add_parser("doctor", add_help=False, help="network health of a job: store, TCP, all-reduce bandwidth, "
                        "slow nodes and links (elastic-ddp doctor --help)")
    return parser


def _parse_options(text: str) -> dict[str, Any]:
    if not text:
        return {}
    try:
        options = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"--storage-options: not valid JSON ({exc})") from exc
    if not isinstance(options, dict):
        raise ConfigError("--storage-options: must be a JSON object")
    return options


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "launch":
        from elastic_ddp.launcher import main as launch_main

        return launch_main(argv[1:])
    if argv and argv[0] == "demo":
        return run_chaos("demo", argv[1:])
    if argv and argv[0] == "doctor":
        from elastic_ddp import doctor

        return doctor.main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        args.options = _parse_options(args.storage_options)
        status = args.func(args)
        sys.stdout.flush()  # a closed pipe is found here, not at interpreter exit
        return status
    except ElasticDDPError as exc:
        print(f"elastic-ddp: error: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # the reader stopped (``elastic-ddp ckpt ls | head``): end as a piped Unix tool does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at interpreter exit
        return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env bash
# Create a virtual environment and install elastic_ddp with its test, chaos and tensorboard extras.
#
#   scripts/setup.sh                  .venv with torch 2.13.0 (the CPU build)
#   scripts/setup.sh --torch 2.14.1   .venv-torch2.14.1 with that release, from the package registry
#
# torch is installed first, on its own and pinned, and named again beside the project, so that pip never
# resolves pyproject.toml's range to a release other than the one asked for (with no torch installed, a
# range takes a multi-GB CUDA build).
# The environment's path is printed on the last line; scripts/test.sh --torch VERSION uses the same one.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH=2.13.0
while [ $# -gt 0 ]; do
    case "$1" in
        --torch) [ $# -ge 2 ] || { echo "scripts/setup.sh: --torch needs a release, e.g. --torch 2.14.1" >&2; exit 2; }
                 TORCH=$2; shift 2 ;;
        --torch=*) TORCH=${1#--torch=}; shift ;;
        -h|--help) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "scripts/setup.sh: unknown argument '$1' (usage: scripts/setup.sh [--torch VERSION])" >&2; exit 2 ;;
    esac
done
# the release must lie in the range pyproject.toml declares: one line, before anything is installed
"$PYTHON" - "$TORCH" <<'PY' || exit 2
import re, sys, tomllib
wanted = sys.argv[1]
spec = next(d for d in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"] if d.startswith("torch"))
def release(text):
    return tuple(int(part) for part in text.split("."))
if not re.fullmatch(r"\d+\.\d+\.\d+", wanted):
    sys.exit(f"scripts/setup.sh: --torch {wanted}: give a release such as 2.14.1 (supported: {spec})")
bounds = re.findall(r"(>=|<)\s*([\d.]+)", spec)
ok = all(release(wanted) >= release(v) if op == ">=" else release(wanted) < release(v) for op, v in bounds)
if not ok:
    sys.exit(f"scripts/setup.sh: torch {wanted} is not supported (supported: {spec})")
PY
if [ "$TORCH" = 2.13.0 ]; then VENV=.venv; else VENV=".venv-torch$TORCH"; fi
# ip, nft and tc for the chaos harness's hosts in network namespaces (chaos/netns.py); tests that need them
# skip with the reason when they are missing or when not root
if [ "$(id -u)" -eq 0 ] && ! { command -v ip && command -v nft && command -v tc && command -v iptables; } >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1 && apt-get install -y --no-install-recommends iproute2 nftables iptables >/dev/null 2>&1 \
        || { apt-get update >/dev/null 2>&1 && apt-get install -y --no-install-recommends iproute2 nftables iptables >/dev/null 2>&1; }; then
        echo "scripts/setup.sh: installed iproute2, nftables and iptables (network-namespace chaos tests)"
    else
        echo "scripts/setup.sh: could not install iproute2/nftables/iptables with apt-get; the network-namespace chaos tests will skip" >&2
    fi
fi
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet "torch==$TORCH" || {
    echo "scripts/setup.sh: pip could not install torch==$TORCH into $VENV (see pip's message above)" >&2; exit 1; }
# torch named again: without it, pip's resolver may replace the installed torch with the newest release in
# range while it backtracks over other packages (seen with pip 26.3: s3fs pins its fsspec)
"$VENV/bin/python" -m pip install --quiet -e ".[test,chaos,tensorboard]" "torch==$TORCH"
"$VENV/bin/python" - "$TORCH" "$VENV" <<'PY'
import sys
import torch, fsspec, pyetcd, safetensors, tensorboard  # noqa: F401  - fail here, not in the first test, if an install is broken
import elastic_ddp
wanted, venv = sys.argv[1], sys.argv[2]
if torch.__version__.split("+")[0] != wanted:
    sys.exit(f"scripts/setup.sh: {venv} holds torch {torch.__version__}, not {wanted}: an install replaced it")
print(f"elastic_ddp {elastic_ddp.__version__} ready in {venv}: torch {torch.__version__}, python {sys.version.split()[0]}")
PY

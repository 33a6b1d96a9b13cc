#!/usr/bin/env bash
# Create .venv and install elastic_ddp with its test, chaos and tensorboard extras.
# torch==2.13.0 is installed first, on its own, so that pip takes the CPU build from the local
# wheel directory instead of resolving pyproject.toml's `torch>=2.13,<2.14` to a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
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
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "torch==${ELASTIC_DDP_TORCH_VERSION:-2.13.0}"
.venv/bin/python -m pip install --quiet -e ".[test,chaos,tensorboard]"
.venv/bin/python - <<'PY'
import torch, fsspec, pyetcd, safetensors, tensorboard  # noqa: F401  - fail here, not in the first test, if an install is broken
import elastic_ddp
print(f"elastic_ddp {elastic_ddp.__version__} ready: torch {torch.__version__}, python {__import__('sys').version.split()[0]}")
PY

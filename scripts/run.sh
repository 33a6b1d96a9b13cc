#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job: a local elastic run of examples/train.py on
# 2 simulated nodes x 1 worker, rendezvousing through an embedded etcd (etcd-v3), checkpoints in
# runs/local/ckpt, node logs and metrics in runs/local. Run it again and it resumes where it
# stopped. Extra arguments go to examples/train.py (see `python examples/train.py --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
mkdir -p runs/local
exec .venv/bin/elastic-ddp launch --nodes 1:2 --nproc-per-node "${NPROC:-1}" --workdir runs/local -- \
    examples/train.py --max-steps 300 --checkpoint-dir runs/local/ckpt --checkpoint-every 50 \
    --log-dir runs/local/logs --log-every 50 --eval-every 100 "$@"

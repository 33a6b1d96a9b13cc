#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the example job: 2 local workers under torchrun's elastic
# agent, checkpoints in runs/local/ckpt, metrics in runs/local/logs. Run it again and it resumes
# where it stopped. Extra arguments go to examples/train.py (see `--help`).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# Each worker-group restart gets a fresh, empty TCPStore instead of torchrun's long-lived agent
# store, whose stale keys from the previous attempt break about half of all restarts
# (elastic_ddp/rendezvous/RESTARTS.md).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
exec .venv/bin/torchrun --standalone --nproc-per-node="${NPROC:-2}" --max-restarts=3 examples/train.py \
    --max-steps 300 --checkpoint-dir runs/local/ckpt --checkpoint-every 50 --log-dir runs/local/logs \
    --log-every 25 --eval-every 100 "$@"

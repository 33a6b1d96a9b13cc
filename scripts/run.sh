#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job: a local elastic run of examples/train.py on
# 2 simulated nodes x 1 worker, rendezvousing through an embedded etcd (etcd-v3), checkpoints in
# runs/local/ckpt, node logs and metrics in runs/local. Run it again and it resumes where it
# stopped. Extra arguments go to examples/train.py (see `python examples/train.py --help`).
#
# The console (elastic-ddp launch) shows rank 0's progress: a live bar on a terminal (step, loss,
# samples/s, ETA), else one line every PROGRESS_EVERY seconds (default 5); and each restart,
# membership change and recovery as it happens, then each node's exit and how the job ended.
# NPROC=N: workers per node (default 1); RUNS=DIR: instead of runs/local; SETUP=0: skip scripts/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${SETUP:-1}" != 0 ]; then scripts/setup.sh; fi
RUNS=${RUNS:-runs/local}
mkdir -p "$RUNS"
exec .venv/bin/elastic-ddp launch --nodes 1:2 --nproc-per-node "${NPROC:-1}" --workdir "$RUNS" \
    --progress-every "${PROGRESS_EVERY:-5}" -- \
    examples/train.py --max-steps 300 --checkpoint-dir "$RUNS/ckpt" --checkpoint-every 50 \
    --log-dir "$RUNS/logs" --log-every 50 --eval-every 100 "$@"

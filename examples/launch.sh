#!/usr/bin/env bash
# Launch examples/train.py on this node under torchrun's elastic agent.
#
# Single node:  NPROC=2 examples/launch.sh --max-steps 200
# Multi-node:   run on every node with the same RDZV_ENDPOINT and RUN_ID, e.g.
#               NNODES=2 NPROC=2 RDZV_ENDPOINT=node0:29400 RUN_ID=job1 examples/launch.sh --checkpoint-dir /shared/ckpt
#               NNODES may be a range (1:4) for an elastic job; RDZV_BACKEND defaults to c10d.
# Workers start from a per-node fork server that imported torch once (elastic_ddp.prefork), so a
# worker-group restart does not import torch again; PREFORK=0 starts each as a new Python process.
# Everything after the variables goes to train.py (see `python examples/train.py --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
NNODES=${NNODES:-1}
NPROC=${NPROC:-2}
TORCHRUN=${TORCHRUN:-.venv/bin/torchrun}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# Each worker-group restart gets a fresh, empty TCPStore instead of torchrun's long-lived agent
# store, whose stale keys from the previous attempt break about half of all restarts
# (elastic_ddp/rendezvous/RESTARTS.md).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
SCRIPT=(examples/train.py)
if [ "${PREFORK:-1}" = "1" ]; then
    SCRIPT=(-m elastic_ddp.prefork examples/train.py)
fi
if [ "$NNODES" = "1" ] && [ -z "${RDZV_ENDPOINT:-}" ]; then
    exec "$TORCHRUN" --standalone --nproc-per-node="$NPROC" "${SCRIPT[@]}" "$@"
fi
: "${RDZV_ENDPOINT:?set RDZV_ENDPOINT=host:port of the rendezvous (c10d store or etcd)}"
exec "$TORCHRUN" --nnodes="$NNODES" --nproc-per-node="$NPROC" \
    --rdzv-backend="${RDZV_BACKEND:-c10d}" --rdzv-endpoint="$RDZV_ENDPOINT" --rdzv-id="${RUN_ID:-elastic-ddp}" \
    --max-restarts="${MAX_RESTARTS:-3}" "${SCRIPT[@]}" "$@"

#!/usr/bin/env bash
# One node's share of a multi-node run: start torchrun here, which starts NPROC_PER_NODE ranks of
# scripts/cluster_train.py and meets the other nodes at MASTER_ADDR:MASTER_PORT (c10d rendezvous).
# Run it once on every node (scripts/slurm_train.sbatch does that with srun), same arguments everywhere:
#
#   NNODES=2 NPROC_PER_NODE=4 NODE_RANK=0 MASTER_ADDR=node01 scripts/torchrun_multinode.sh --sp 4 --backend auto
#   NNODES=2 NPROC_PER_NODE=4 NODE_RANK=1 MASTER_ADDR=node01 scripts/torchrun_multinode.sh --sp 4 --backend auto
#
# Environment (defaults in brackets):
#   NNODES [1]  NPROC_PER_NODE [1]  NODE_RANK [0]  MASTER_ADDR [127.0.0.1]  MASTER_PORT [29500]
#   RDZV_ID [lightning-sp]: the same on every node of one job, different between jobs
#   PYTHON [python3]: the interpreter with lightning_sp installed (or importable from this checkout)
#   DRY_RUN=1: print the command instead of running it
# Every argument is passed to scripts/cluster_train.py (see its --help).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cmd=("${PYTHON:-python3}" -m torch.distributed.run
     --nnodes="${NNODES:-1}" --nproc-per-node="${NPROC_PER_NODE:-1}" --node-rank="${NODE_RANK:-0}"
     --rdzv-backend=c10d --rdzv-endpoint="${MASTER_ADDR:-127.0.0.1}:${MASTER_PORT:-29500}"
     --rdzv-id="${RDZV_ID:-lightning-sp}" --max-restarts=0
     "$ROOT/scripts/cluster_train.py" "$@")
if [[ "${DRY_RUN:-0}" == 1 ]]; then
    printf '%q ' "${cmd[@]}"; echo
    exit 0
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # the ranks import lightning_sp from this checkout
exec "${cmd[@]}"

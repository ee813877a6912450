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
#   MAX_RESTARTS [3]: when a rank dies, torchrun stops the others and starts them all again, this many times;
#       cluster_train.py resumes each run from its last checkpoint (docs/guides/preemption.md)
#   PYTHON [python3]: the interpreter with lightning_sp installed (or importable from this checkout)
#   DRY_RUN=1: print the command instead of running it
# Every argument is passed to scripts/cluster_train.py (see its --help).
#
# TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 is set for torchrun: with the rendezvous store shared with the ranks
# (torch's default), the ranks of a restart read the dead ranks' addresses from it and every restart fails
# in init_process_group (pytorch #135712); tests/distributed/test_restarts.py restarts a killed rank both ways.
# SIGUSR1 (SLURM's warning signal, --signal=USR1@...) is ignored by torchrun: SLURM signals every process of
# the step, and the signal's default action would end the agent with its ranks still training;
# cluster_train.py restores it in the ranks, where Lightning's requeue handler takes it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cmd=(env TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"
     "${PYTHON:-python3}" -m torch.distributed.run
     --nnodes="${NNODES:-1}" --nproc-per-node="${NPROC_PER_NODE:-1}" --node-rank="${NODE_RANK:-0}"
     --rdzv-backend=c10d --rdzv-endpoint="${MASTER_ADDR:-127.0.0.1}:${MASTER_PORT:-29500}"
     --rdzv-id="${RDZV_ID:-lightning-sp}" --max-restarts="${MAX_RESTARTS:-3}"
     "$ROOT/scripts/cluster_train.py" "$@")
if [[ "${DRY_RUN:-0}" == 1 ]]; then
    printf '%q ' "${cmd[@]}"; echo
    exit 0
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # the ranks import lightning_sp from this checkout
trap '' USR1
exec "${cmd[@]}"

#!/usr/bin/env bash
# Megatron-LM GPT pre-training with EnvPipe on one node, with plain torchrun.
#
#   MEGATRON_LM=$HOME/Megatron-LM bash examples/torchrun_single_node.sh [extra pretrain_gpt flags]
#   ENVPIPE_TYPE=baseline ENVPIPE_SCHEDULING=1f1b MEGATRON_LM=... bash examples/torchrun_single_node.sh  # 1F1B order, f_max
#   ENVPIPE_DISABLE=1 MEGATRON_LM=... bash examples/torchrun_single_node.sh   # stock Megatron, no EnvPipe
#   ENVPIPE_EXAMPLE=tiny-cpu bash examples/torchrun_single_node.sh     # tiny GPT, 4 CPU ranks, no GPU
#
# Same body, knobs and argument arrays as the SLURM script
# (examples/slurm/pretrain_gpt_envpipe.sbatch, sharing examples/slurm/envpipe_common.sh):
# ENVPIPE_* for EnvPipe, GPUS_PER_NODE, TP, PP, model and data sizes, paths.
# GPU clocks are reset when torchrun ends, however it ends (Ctrl-C included).
set -euo pipefail

ENVPIPE_SCRIPTS=$(cd "$(dirname "${BASH_SOURCE[0]}")/slurm" && pwd)
# shellcheck source-path=SCRIPTDIR source=slurm/envpipe_common.sh
source "$ENVPIPE_SCRIPTS/envpipe_common.sh"

# ----------------------------------------------------------------------------- node and ranks
NNODES=1
NODE_RANK=0
if [ "$ENVPIPE_EXAMPLE" = tiny-cpu ]; then
    GPUS_PER_NODE=${GPUS_PER_NODE:-4}   # CPU ranks
else
    GPUS_PER_NODE=${GPUS_PER_NODE:-8}
fi
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-29500}

DISTRIBUTED_ARGS=(
    --nproc-per-node "$GPUS_PER_NODE"
    --nnodes "$NNODES"
    --node-rank "$NODE_RANK"
    --master-addr "$MASTER_ADDR"
    --master-port "$MASTER_PORT"
)
envpipe_compose_args

# ----------------------------------------------------------------------------- run
envpipe_node_run "$PYTHON" -m torch.distributed.run \
    "${DISTRIBUTED_ARGS[@]}" \
    "${ENTRY_ARGS[@]}" \
    "${GPT_MODEL_ARGS[@]}" \
    "${TRAINING_ARGS[@]}" \
    "${MODEL_PARALLEL_ARGS[@]}" \
    "${DATA_ARGS[@]}" \
    "${EVAL_AND_LOGGING_ARGS[@]}" \
    "${ENVPIPE_ARGS[@]}" \
    "$@"

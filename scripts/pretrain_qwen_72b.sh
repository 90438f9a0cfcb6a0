#!/usr/bin/env bash
# Qwen2.5-72B pretraining after MindSpeed-LLM's published recipes, at sequence length 4096 (default) or 32768:
#
#   SEQ_LENGTH=4096   the 4k recipe's layout: 4 nodes x 8 devices, TP 8 x PP 4 with 5 virtual stages of 4
#                     layers, sequence parallel, global batch 128, overlapped grad reduce and param gather.
#                     Micro-batch 1, not the recipe's 2: the recipe fits 2 with MindSpeed's own memory savers
#                     (--swap-attention, --recompute-activation-function, --reuse-fp32-param), which megatron-core
#                     has not; at 2 stage 0 would need 64.0 GiB, more than a 64 GB device's 59.6 GiB, at 1 it
#                     needs 51.7 GiB with the same global batch and no recompute.
#   SEQ_LENGTH=32768  the 32k recipe's layout: 16 nodes x 8 devices, TP 8 x PP 4 x CP 4 (ring attention,
#                     --cp-comm-type p2p, as the recipe's megatron_cp_algo), sequence parallel, micro-batch 1,
#                     global batch 32, overlapped grad reduce, no recompute; 20 layers a stage where the recipe
#                     has 17,20,22,21 (--num-layer-list is MindSpeed's). Stage 0 needs 41.1 GiB.
# Both: bf16, distributed optimizer, flash attention (RoPE and SwiGLU fusions are megatron's defaults,
# RMSNorm comes from the adapter's kernel provider).
#
# Run the same command on every node, NODE_RANK 0..NNODES-1, after sourcing CANN's set_env.sh on Ascend:
#
#   DATA_PATH=/data/pile_text_document TOKENIZER_MODEL=/models/Qwen2.5-72B CKPT_LOAD_DIR=/ckpt/qwen72b \
#   CKPT_SAVE_DIR=/ckpt/qwen72b-pt NODE_RANK=0 MASTER_ADDR=10.0.0.1 bash scripts/pretrain_qwen_72b.sh
#
#   DRY_RUN=1 bash scripts/pretrain_qwen_72b.sh                    # the command and each device's memory
#   SEQ_LENGTH=32768 DRY_RUN=1 bash scripts/pretrain_qwen_72b.sh   # the same for the 32k layout
#
# Environment (default):
#   SEQ_LENGTH         4096 or 32768 (4096): picks the layout above
#   DATA_PATH          dataset prefix, or "WEIGHT PREFIX WEIGHT PREFIX ..." for a blend (required)
#   TOKENIZER_MODEL    Hugging Face tokenizer directory, e.g. the Qwen2.5-72B download (required)
#   CKPT_LOAD_DIR      checkpoint to start from, e.g. from scripts/convert_checkpoint.py (none: from scratch)
#   CKPT_SAVE_DIR      where to save every SAVE_INTERVAL (2000) iterations (none: no checkpoints)
#   TENSORBOARD_DIR    tensorboard logs (none)
#   NNODES (4 at 4096, 16 at 32768, the recipes'), NODE_RANK (0), NPROC_PER_NODE (8), MASTER_ADDR (localhost),
#   MASTER_PORT (6000), TRAIN_ITERS (2000), DIST_TIMEOUT_MINUTES (30), MAX_RESTARTS (3), RDZV_ID
#   (pretrain-MASTER_ADDR-MASTER_PORT), PYTHON (python3, for the plan)
#   EXTRA_ARGS         more pretrain_gpt.py arguments, appended, so they win over the ones here
#                      (e.g. "--recompute-granularity full --recompute-method uniform"); the plan sees them too
#
# The backend is the adapter's automatic choice (ADAPTER_BACKEND unset): HCCL on Ascend, NCCL on NVIDIA.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source-path=SCRIPTDIR source=lib/cluster_launch.sh
source "$ROOT/scripts/lib/cluster_launch.sh"

: "${SEQ_LENGTH:=4096}"
case "$SEQ_LENGTH" in
    4096)
        : "${NNODES:=4}"
        LAYOUT=(--tensor-model-parallel-size 8 --pipeline-model-parallel-size 4
                --num-layers-per-virtual-pipeline-stage 4 --overlap-param-gather
                --micro-batch-size 1 --global-batch-size 128) ;;
    32768)
        : "${NNODES:=16}"
        LAYOUT=(--tensor-model-parallel-size 8 --pipeline-model-parallel-size 4
                --context-parallel-size 4 --cp-comm-type p2p
                --micro-batch-size 1 --global-batch-size 32) ;;
    *)
        echo "error: SEQ_LENGTH=$SEQ_LENGTH: the recipes are for 4096 or 32768; set one of them" >&2
        exit 2 ;;
esac
cluster_defaults      # the other environment defaults and the collective libraries' settings
require_data_env      # DATA_PATH and TOKENIZER_MODEL, unless DRY_RUN=1; DATA_PATH split into DATA

ARGS=(
    --model qwen2.5-72b
    "${LAYOUT[@]}"
    --sequence-parallel
    --use-distributed-optimizer
    --overlap-grad-reduce
    --use-flash-attn
    --no-create-attention-mask-in-dataloader
    --bf16
    --seq-length "$SEQ_LENGTH"
    --max-position-embeddings "$SEQ_LENGTH"
)

# + checkpoints, tensorboard and EXTRA_ARGS; DRY_RUN=1: print and exit, else the plan, then torchrun
add_recipe_training_args   # the recipe's training settings, shared by the launchers
launch_or_dry_run "${ARGS[@]}"

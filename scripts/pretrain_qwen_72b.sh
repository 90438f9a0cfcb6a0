#!/usr/bin/env bash
# Qwen2.5-72B pretraining at sequence length 4096, the layout of MindSpeed-LLM's published 4k recipe:
# 4 nodes x 8 devices, TP 8 x PP 4 with 5 virtual stages of 4 layers, sequence parallel, bf16, distributed
# optimizer with overlapped grad reduce and param gather, flash attention (RoPE and SwiGLU fusions are
# megatron's defaults, RMSNorm comes from the adapter's kernel provider).
#
# Run the same command on every node, NODE_RANK 0..NNODES-1, after sourcing CANN's set_env.sh on Ascend:
#
#   DATA_PATH=/data/pile_text_document TOKENIZER_MODEL=/models/Qwen2.5-72B CKPT_LOAD_DIR=/ckpt/qwen72b \
#   CKPT_SAVE_DIR=/ckpt/qwen72b-pt NODE_RANK=0 MASTER_ADDR=10.0.0.1 bash scripts/pretrain_qwen_72b.sh
#
#   DRY_RUN=1 bash scripts/pretrain_qwen_72b.sh     # the command and each device's memory; launches nothing
#
# Environment (default):
#   DATA_PATH          dataset prefix, or "WEIGHT PREFIX WEIGHT PREFIX ..." for a blend (required)
#   TOKENIZER_MODEL    Hugging Face tokenizer directory, e.g. the Qwen2.5-72B download (required)
#   CKPT_LOAD_DIR      checkpoint to start from, e.g. from scripts/convert_checkpoint.py (none: from scratch)
#   CKPT_SAVE_DIR      where to save every SAVE_INTERVAL (2000) iterations (none: no checkpoints)
#   TENSORBOARD_DIR    tensorboard logs (none)
#   NNODES (4, the recipe's), NODE_RANK (0), NPROC_PER_NODE (8), MASTER_ADDR (localhost), MASTER_PORT (6000)
#   TRAIN_ITERS (2000), DIST_TIMEOUT_MINUTES (30), PYTHON (python3, for the plan)
#   EXTRA_ARGS         more pretrain_gpt.py arguments, appended, so they win over the ones here
#                      (e.g. "--recompute-granularity full --recompute-method uniform"); the plan sees them too
#
# The backend is the adapter's automatic choice (ADAPTER_BACKEND unset): HCCL on Ascend, NCCL on NVIDIA.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source-path=SCRIPTDIR source=lib/cluster_launch.sh
source "$ROOT/scripts/lib/cluster_launch.sh"

: "${NNODES:=4}"
cluster_defaults      # the other environment defaults and the collective libraries' settings
require_data_env      # DATA_PATH and TOKENIZER_MODEL, unless DRY_RUN=1; DATA_PATH split into DATA

# shellcheck disable=SC2054  # "--split 100,0,0" is one word, its commas are no array separators
ARGS=(
    --model qwen2.5-72b
    --tensor-model-parallel-size 8
    --pipeline-model-parallel-size 4
    --num-layers-per-virtual-pipeline-stage 4
    --sequence-parallel
    --use-distributed-optimizer
    --overlap-grad-reduce
    --overlap-param-gather
    --use-flash-attn
    --no-create-attention-mask-in-dataloader
    --bf16
    --seq-length 4096
    --max-position-embeddings 4096
    --micro-batch-size 2
    --global-batch-size 128
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --init-method-std 0.01
    --train-iters "$TRAIN_ITERS"
    --lr 1.25e-6
    --min-lr 1.25e-7
    --lr-decay-style cosine
    --lr-warmup-fraction 0.01
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --clip-grad 1.0
    --seed 42
    --data-path "${DATA[@]}"
    --split 100,0,0
    --tokenizer-type HuggingFaceTokenizer
    --tokenizer-model "${TOKENIZER_MODEL:-UNSET_TOKENIZER_MODEL}"
    --eval-interval 2000
    --eval-iters 0
    --log-interval 1
    --distributed-timeout-minutes "$DIST_TIMEOUT_MINUTES"
)

# + checkpoints, tensorboard and EXTRA_ARGS; DRY_RUN=1: print and exit, else the plan, then torchrun
launch_or_dry_run "${ARGS[@]}"

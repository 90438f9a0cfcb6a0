#!/usr/bin/env bash
# Qwen3.5-9B (hybrid dense: 32 layers, three Gated DeltaNet to one gated attention) pretraining at sequence
# length 4096 on one node of 8 devices with 64 GB each.
#
# Recipe: no published megatron recipe for Qwen3.5 was at hand, so this one is the project's Qwen3-8B
# launcher (scripts/pretrain_qwen3_8b.sh, after MindSpeed-LLM's Qwen3-8B recipe) carried over: TP 2 x PP 2
# x DP 2, micro-batch 1, global batch 64, and the shared training settings (lr 1.25e-6 cosine to 1.25e-7, 1%
# warmup, weight decay 0.1, betas 0.9/0.95, clip 1.0, init std 0.01, bf16, distributed optimizer with
# overlapped grad reduce and param gather, flash attention for the gated attention layers).
#
# What differs from it, and why: nothing in the layout. TP 2 divides Gated DeltaNet's 16 key and 32 value
# heads and the 16 query and 4 key-value heads; PP 2 gives each stage 16 model layers (megatron's hybrid stack:
# 32 of its own, a mixer then an MLP each). The memory plan is 35.3 GiB at the peak (pipeline rank 0, with
# the most micro-batches in flight), without recompute; it counts Gated DeltaNet's activations as
# flash-linear-attention's kernel keeps them (flow/memory_plan.py), so on Ascend, where the torch
# implementation runs, size the micro-batch from a short run first.
#
#   DATA_PATH=/data/pile_text_document TOKENIZER_MODEL=/models/Qwen3.5-9B bash scripts/pretrain_qwen35_9b.sh
#   DRY_RUN=1 bash scripts/pretrain_qwen35_9b.sh   # the command and each device's memory; launches nothing
#
# Environment (default): as scripts/pretrain_qwen3_8b.sh: DATA_PATH, TOKENIZER_MODEL (required), CKPT_LOAD_DIR,
# CKPT_SAVE_DIR, TENSORBOARD_DIR, NNODES (1), NODE_RANK (0), NPROC_PER_NODE (8), MASTER_ADDR (localhost),
# MASTER_PORT (6000), TRAIN_ITERS (2000), SAVE_INTERVAL (2000), DIST_TIMEOUT_MINUTES (30), PYTHON (python3),
# EXTRA_ARGS (appended, so they win; the plan sees them too).
#
# The backend is the adapter's automatic choice (ADAPTER_BACKEND unset): HCCL on Ascend, NCCL on NVIDIA.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source-path=SCRIPTDIR source=lib/cluster_launch.sh
source "$ROOT/scripts/lib/cluster_launch.sh"

: "${NNODES:=1}"
cluster_defaults      # the other environment defaults and the collective libraries' settings
require_data_env      # DATA_PATH and TOKENIZER_MODEL, unless DRY_RUN=1; DATA_PATH split into DATA

ARGS=(
    --model qwen3.5-9b
    --tensor-model-parallel-size 2
    --pipeline-model-parallel-size 2
    --sequence-parallel
    --use-distributed-optimizer
    --overlap-grad-reduce
    --overlap-param-gather
    --use-flash-attn
    --no-create-attention-mask-in-dataloader
    --bf16
    --seq-length 4096
    --max-position-embeddings 4096
    --micro-batch-size 1
    --global-batch-size 64
)

# + checkpoints, tensorboard and EXTRA_ARGS; DRY_RUN=1: print and exit, else the plan, then torchrun
add_recipe_training_args   # the recipe's training settings, shared by the launchers
launch_or_dry_run "${ARGS[@]}"

#!/usr/bin/env bash
# Qwen3.5-397B-A17B (hybrid MoE: 60 layers, three Gated DeltaNet to one gated attention, 512 experts, top 10
# and a gated shared expert) pretraining at sequence length 4096 on 256 devices with 64 GB each: 32 nodes x 8
# (Atlas 800T A2, or 8-GPU nodes), or NNODES=16 NPROC_PER_NODE=16 (Atlas A3).
#
# Recipe: no published megatron recipe for Qwen3.5 was at hand, so this one is the project's Qwen3-235B-A22B
# launcher (scripts/pretrain_qwen3_235b_a22b.sh, after MindSpeed-LLM's 235B recipe) carried over, with its
# training settings (lr 1.25e-6 cosine to 1.25e-7, 1% warmup, weight decay 0.1, betas 0.9/0.95, clip 1.0,
# init std 0.01, bf16, aux-loss load balancing of coefficient 1e-3, grouped expert GEMMs, all-to-all token
# dispatch, full recompute, distributed optimizer with overlapped grad reduce and param gather, flash
# attention for the gated attention layers).
#
# What differs from it, and why:
# - TP 2 x PP 4 x EP 32 (16 of the 512 experts on each device, each split over expert TP 2, expert DP 1):
#   60 layers split evenly over 4 stages (15 each; megatron's hybrid stack holds 30 of its own layers a
#   stage, each model layer being a mixer then a MoE block), and TP 2 divides Gated DeltaNet's 16 key and 64
#   value heads as well as the 32 query and 2 key-value heads.
# - Global batch 256: the plan's 8 micro-batches per step at DP 32. The memory plan is 37.5 GiB at the peak
#   (pipeline rank 3, with the output layer); it counts Gated DeltaNet's activations as flash-linear-attention's
#   kernel keeps them (flow/memory_plan.py), so on Ascend, where the torch implementation runs,
#   size the micro-batch from a short run first.
# - The sequence length is 4096, not the model's 262,144 positions: a pretraining stage, as the other launchers.
#
# Run the same command on every node, NODE_RANK 0..NNODES-1, after sourcing CANN's set_env.sh on Ascend:
#
#   DATA_PATH=/data/pile_text_document TOKENIZER_MODEL=/models/Qwen3.5-397B-A17B \
#   CKPT_LOAD_DIR=/ckpt/qwen35-397b CKPT_SAVE_DIR=/ckpt/qwen35-397b-pt NODE_RANK=0 MASTER_ADDR=10.0.0.1 \
#   bash scripts/pretrain_qwen35_397b_a17b.sh
#
#   DRY_RUN=1 bash scripts/pretrain_qwen35_397b_a17b.sh   # the command and each device's memory; launches nothing
#
# CKPT_LOAD_DIR: the published (multimodal) checkpoint converted with scripts/convert_checkpoint.py hf-to-mcore,
# which converts its language model and says in one line what it leaves (the vision tower).
#
# Environment (default):
#   DATA_PATH          dataset prefix, or "WEIGHT PREFIX WEIGHT PREFIX ..." for a blend (required)
#   TOKENIZER_MODEL    Hugging Face tokenizer directory, e.g. the Qwen3.5-397B-A17B download (required)
#   CKPT_LOAD_DIR      checkpoint to start from (none: from scratch)
#   CKPT_SAVE_DIR      where to save every SAVE_INTERVAL (2000) iterations (none: no checkpoints)
#   TENSORBOARD_DIR    tensorboard logs (none)
#   NNODES (32), NODE_RANK (0), NPROC_PER_NODE (8), MASTER_ADDR (localhost), MASTER_PORT (6000)
#   TRAIN_ITERS (2000), DIST_TIMEOUT_MINUTES (30), PYTHON (python3, for the plan)
#   EXTRA_ARGS         more pretrain_gpt.py arguments, appended, so they win over the ones here; the plan
#                      sees them too
#
# The backend is the adapter's automatic choice (ADAPTER_BACKEND unset): HCCL on Ascend, NCCL on NVIDIA.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source-path=SCRIPTDIR source=lib/cluster_launch.sh
source "$ROOT/scripts/lib/cluster_launch.sh"

: "${NNODES:=32}"
cluster_defaults      # the other environment defaults and the collective libraries' settings
require_data_env      # DATA_PATH and TOKENIZER_MODEL, unless DRY_RUN=1; DATA_PATH split into DATA

ARGS=(
    --model qwen3.5-397b-a17b
    --tensor-model-parallel-size 2
    --pipeline-model-parallel-size 4
    --expert-model-parallel-size 32
    --sequence-parallel
    --moe-grouped-gemm
    --moe-permute-fusion
    --moe-token-dispatcher-type alltoall
    --moe-router-load-balancing-type aux_loss
    --moe-aux-loss-coeff 1e-3
    --recompute-granularity full
    --recompute-method uniform
    --recompute-num-layers 1
    --use-distributed-optimizer
    --overlap-grad-reduce
    --overlap-param-gather
    --use-flash-attn
    --no-create-attention-mask-in-dataloader
    --bf16
    --seq-length 4096
    --max-position-embeddings 4096
    --micro-batch-size 1
    --global-batch-size 256
)

# + checkpoints, tensorboard and EXTRA_ARGS; DRY_RUN=1: print and exit, else the plan, then torchrun
add_recipe_training_args   # the recipe's training settings, shared by the launchers
launch_or_dry_run "${ARGS[@]}"

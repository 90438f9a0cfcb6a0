#!/usr/bin/env bash
# Kimi-K2 (1.03T, 32B activated: DeepSeek-V3's architecture with 64 attention heads, 384 routed experts of
# which each token takes 8, a shared expert, the first layer dense, no MTP layer) pretraining at sequence
# length 4096 on 512 devices with 64 GB each: 64 nodes x 8 (Atlas 800T A2, or 8-GPU nodes), or NNODES=32
# NPROC_PER_NODE=16 (Atlas A3).
#
# Recipe: no published megatron recipe for Kimi-K2 was at hand. Its technical report trains it with 16-way
# pipeline parallelism (virtual stages), 16-way expert parallelism and ZeRO-1 (the distributed optimizer) on
# 80 GB devices, with selective recompute and activations offloaded or kept in FP8; this launcher is
# the project's DeepSeek-V3 one (scripts/pretrain_deepseek_v3.sh, after MindSpeed-LLM's 671B recipe: TP 1,
# full recompute of every layer, micro-batch 1, global batch 7680, grouped expert GEMMs, all-to-all token
# dispatch, the sequence-wise balance loss of 1e-4 beside the expert bias, the router in fp32, flash
# attention, bf16) carried over to the larger model.
#
# What differs from it, and why:
# - EP 32, not the report's 16, so that a device's experts fit 64 GB (at EP 16 it would hold 24 a layer);
#   PP 16 x EP 32 (12 of the 384 experts on each device, expert DP 1) instead of PP 8 x EP 64: the 60 MoE
#   layers' experts are 1.5x DeepSeek-V3's, and at 8 stages a device would hold 8 layers x 6 experts, 50.1
#   GiB in the plan; at 16 stages it holds 4 x 12 (fewer layers, each of more experts), 42.2 GiB at the peak.
# - The uneven split of the 61 layers is 3 on the first stage (the dense one and the embedding), 4 on each of
#   the 14 middle ones, 2 on the last (with the output layer over a 163,840-token vocabulary); no MTP layer.
#
# Run the same command on every node, NODE_RANK 0..NNODES-1, after sourcing CANN's set_env.sh on Ascend:
#
#   DATA_PATH=/data/pile_text_document TOKENIZER_MODEL=/models/Kimi-K2-Base \
#   CKPT_LOAD_DIR=/ckpt/kimi-k2 CKPT_SAVE_DIR=/ckpt/kimi-k2-pt NODE_RANK=0 MASTER_ADDR=10.0.0.1 \
#   bash scripts/pretrain_kimi_k2.sh
#
#   DRY_RUN=1 bash scripts/pretrain_kimi_k2.sh   # the command and each device's memory; launches nothing
#
# CKPT_LOAD_DIR: the published (FP8) checkpoint converted with scripts/convert_checkpoint.py hf-to-mcore.
#
# Environment (default):
#   DATA_PATH          dataset prefix, or "WEIGHT PREFIX WEIGHT PREFIX ..." for a blend (required)
#   TOKENIZER_MODEL    Hugging Face tokenizer directory, e.g. the Kimi-K2-Base download (required)
#   CKPT_LOAD_DIR      checkpoint to start from (none: from scratch)
#   CKPT_SAVE_DIR      where to save every SAVE_INTERVAL (2000) iterations (none: no checkpoints)
#   TENSORBOARD_DIR    tensorboard logs (none)
#   NNODES (64), NODE_RANK (0), NPROC_PER_NODE (8), MASTER_ADDR (localhost), MASTER_PORT (6000)
#   TRAIN_ITERS (2000), DIST_TIMEOUT_MINUTES (30), PYTHON (python3, for the plan)
#   EXTRA_ARGS         more pretrain_gpt.py arguments, appended, so they win over the ones here; the plan
#                      sees them too
#
# The backend is the adapter's automatic choice (ADAPTER_BACKEND unset): HCCL on Ascend, NCCL on NVIDIA.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source-path=SCRIPTDIR source=lib/cluster_launch.sh
source "$ROOT/scripts/lib/cluster_launch.sh"

: "${NNODES:=64}"
cluster_defaults      # the other environment defaults and the collective libraries' settings
require_data_env      # DATA_PATH and TOKENIZER_MODEL, unless DRY_RUN=1; DATA_PATH split into DATA

ARGS=(
    --model kimi-k2
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 16
    --decoder-first-pipeline-num-layers 3
    --decoder-last-pipeline-num-layers 2
    --expert-model-parallel-size 32
    --expert-tensor-parallel-size 1
    --moe-grouped-gemm
    --moe-permute-fusion
    --moe-token-dispatcher-type alltoall
    --moe-router-load-balancing-type seq_aux_loss
    --moe-aux-loss-coeff 1e-4
    --moe-router-dtype fp32
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
    --max-position-embeddings 131072
    --micro-batch-size 1
    --global-batch-size 7680
)

# + checkpoints, tensorboard and EXTRA_ARGS; DRY_RUN=1: print and exit, else the plan, then torchrun
add_recipe_training_args   # the recipe's training settings, shared by the launchers
launch_or_dry_run "${ARGS[@]}"

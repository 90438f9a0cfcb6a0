#!/usr/bin/env bash
# Qwen3-30B-A3B (MoE: 48 layers of 128 experts, top 8) pretraining at sequence length 4096 on 2 nodes of 8
# devices with 64 GB each.
#
# Recipe: MindSpeed-LLM's examples/mcore/qwen3_moe/pretrain_qwen3_30b_a3b_4K_ptd.sh, followed as it is:
# 2 nodes x 8 NPUs, TP 1 x PP 4 x EP 4 (32 of the 128 experts per device, expert DP 1), full recompute
# (uniform, 1 layer), micro-batch 1, global batch 256, aux-loss load balancing of coefficient 1e-3, grouped
# expert GEMMs, all-to-all token dispatch, lr 1.25e-6 cosine to 1.25e-7, 1% warmup, weight decay 0.1, betas
# 0.9/0.95, clip 1.0, init std 0.01, bf16, distributed optimizer, flash attention. Megatron-Bridge's
# qwen3_30b_a3b pretrain config runs TP 4 x PP 2 x EP 4 with full recompute on 80 GB GPUs.
#
# What differs, and why: megatron-core's "alltoall" dispatcher for MindSpeed's "alltoall_seq" (which
# megatron-core 0.16 no longer has) and megatron's --moe-permute-fusion for MindSpeed's
# --moe-permutation-async-comm; grad reduce and param gather are overlapped (--overlap-grad-reduce,
# --overlap-param-gather), as MindSpeed's 8B and 235B-A22B recipes do. The memory plan is 38.6 GiB at the
# peak (pipeline rank 3, with the output layer); without recompute it would be 56.0 GiB on rank 0, too
# near 64 GB. --sequence-parallel does nothing at TP 1 and is there so that EXTRA_ARGS can raise TP (megatron
# trains MoE at TP > 1 only with it).
#
# Run the same command on every node, NODE_RANK 0..NNODES-1, after sourcing CANN's set_env.sh on Ascend:
#
#   DATA_PATH=/data/pile_text_document TOKENIZER_MODEL=/models/Qwen3-30B-A3B-Base \
#   CKPT_LOAD_DIR=/ckpt/qwen3-30b-a3b CKPT_SAVE_DIR=/ckpt/qwen3-30b-a3b-pt NODE_RANK=0 MASTER_ADDR=10.0.0.1 \
#   bash scripts/pretrain_qwen3_30b_a3b.sh
#
#   DRY_RUN=1 bash scripts/pretrain_qwen3_30b_a3b.sh   # the command and each device's memory; launches nothing
#
# Environment (default):
#   DATA_PATH          dataset prefix, or "WEIGHT PREFIX WEIGHT PREFIX ..." for a blend (required)
#   TOKENIZER_MODEL    Hugging Face tokenizer directory, e.g. the Qwen3-30B-A3B-Base download (required)
#   CKPT_LOAD_DIR      checkpoint to start from, e.g. from scripts/convert_checkpoint.py (none: from scratch)
#   CKPT_SAVE_DIR      where to save every SAVE_INTERVAL (2000) iterations (none: no checkpoints)
#   TENSORBOARD_DIR    tensorboard logs (none)
#   NNODES (2, the recipe's), NODE_RANK (0), NPROC_PER_NODE (8), MASTER_ADDR (localhost), MASTER_PORT (6000)
#   TRAIN_ITERS (2000), DIST_TIMEOUT_MINUTES (30), PYTHON (python3, for the plan)
#   EXTRA_ARGS         more pretrain_gpt.py arguments, appended, so they win over the ones here
#                      (e.g. "--expert-model-parallel-size 8"); the plan sees them too
#
# The backend is the adapter's automatic choice (ADAPTER_BACKEND unset): HCCL on Ascend, NCCL on NVIDIA.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source-path=SCRIPTDIR source=lib/cluster_launch.sh
source "$ROOT/scripts/lib/cluster_launch.sh"

: "${NNODES:=2}"
cluster_defaults      # the other environment defaults and the collective libraries' settings
require_data_env      # DATA_PATH and TOKENIZER_MODEL, unless DRY_RUN=1; DATA_PATH split into DATA

ARGS=(
    --model qwen3-30b-a3b
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 4
    --expert-model-parallel-size 4
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

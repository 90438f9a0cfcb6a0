#!/usr/bin/env bash
# Qwen3-235B-A22B (MoE: 94 layers of 128 experts, top 8) pretraining at sequence length 4096 on 256 devices
# with 64 GB each: 32 nodes x 8 (Atlas 800T A2, or 8-GPU nodes), or NNODES=16 NPROC_PER_NODE=16 (Atlas A3).
#
# Recipe: MindSpeed-LLM's examples/mcore/qwen3_moe/pretrain_qwen3_235b_a22b_4k_A3_ptd.sh: 16 nodes x 16 NPU
# dies (256), TP 2 x PP 4 with virtual stages of 8 layers, EP 32 extended over TP (--moe-tp-extend-ep: the
# 128 experts over 64 devices, 2 each, none split), full recompute of every layer, micro-batch 1, global
# batch 1024, aux-loss load balancing of coefficient 1e-3, grouped expert GEMMs, all-to-all token dispatch,
# lr 1.25e-6 cosine to 1.25e-7, 1% warmup, weight decay 0.1, betas 0.9/0.95, clip 1.0, init std 0.01, bf16,
# distributed optimizer with overlapped grad reduce and param gather, flash attention. Megatron-Bridge's
# qwen3_235b_a22b pretrain config also takes 256 GPUs (80 GB): TP 4 x PP 16 x CP 2 x EP 8.
#
# What differs, and why:
# - PP 2 (47 layers a stage, no virtual stages) instead of PP 4 x VPP: both recipes reach an even split by
#   padding 94 layers to 96 (MindSpeed's --noop-layers 94,95; Megatron-Bridge's embedding and loss counted
#   as layers), which megatron-core's arguments here do not offer; 94 = 2 x 47, so PP is 2 (or 47).
# - EP 64 with expert TP 1 is megatron-core's spelling of MindSpeed's TP 2 x EP 32 with --moe-tp-extend-ep:
#   the same 2 experts whole on each device, expert DP 2.
# - Full recompute uniform over 1 layer instead of block over 8: every layer recomputed either way (the
#   recipe's virtual stages are 8 layers long). The memory plan is 33.9 GiB at the peak (pipeline rank 1,
#   with the output layer); without recompute rank 0 would hold 2 micro-batches of 47 layers, 71.9 GiB.
# - megatron-core's "alltoall" dispatcher for MindSpeed's "alltoall_seq", and --moe-permute-fusion for its
#   --moe-permutation-async-comm / --moe-alltoall-overlap-comm.
#
# Run the same command on every node, NODE_RANK 0..NNODES-1, after sourcing CANN's set_env.sh on Ascend:
#
#   DATA_PATH=/data/pile_text_document TOKENIZER_MODEL=/models/Qwen3-235B-A22B \
#   CKPT_LOAD_DIR=/ckpt/qwen3-235b CKPT_SAVE_DIR=/ckpt/qwen3-235b-pt NODE_RANK=0 MASTER_ADDR=10.0.0.1 \
#   bash scripts/pretrain_qwen3_235b_a22b.sh
#
#   DRY_RUN=1 bash scripts/pretrain_qwen3_235b_a22b.sh   # the command and each device's memory; launches nothing
#
# Environment (default):
#   DATA_PATH          dataset prefix, or "WEIGHT PREFIX WEIGHT PREFIX ..." for a blend (required)
#   TOKENIZER_MODEL    Hugging Face tokenizer directory, e.g. the Qwen3-235B-A22B download (required)
#   CKPT_LOAD_DIR      checkpoint to start from, e.g. from scripts/convert_checkpoint.py (none: from scratch)
#   CKPT_SAVE_DIR      where to save every SAVE_INTERVAL (2000) iterations (none: no checkpoints)
#   TENSORBOARD_DIR    tensorboard logs (none)
#   NNODES (32), NODE_RANK (0), NPROC_PER_NODE (8), MASTER_ADDR (localhost), MASTER_PORT (6000)
#   TRAIN_ITERS (2000), DIST_TIMEOUT_MINUTES (30), PYTHON (python3, for the plan)
#   EXTRA_ARGS         more pretrain_gpt.py arguments, appended, so they win over the ones here
#                      (e.g. "--recompute-method block --recompute-num-layers 30"); the plan sees them too
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
    --model qwen3-235b-a22b
    --tensor-model-parallel-size 2
    --pipeline-model-parallel-size 2
    --expert-model-parallel-size 64
    --expert-tensor-parallel-size 1
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
    --global-batch-size 1024
)

# + checkpoints, tensorboard and EXTRA_ARGS; DRY_RUN=1: print and exit, else the plan, then torchrun
add_recipe_training_args   # the recipe's training settings, shared by the launchers
launch_or_dry_run "${ARGS[@]}"

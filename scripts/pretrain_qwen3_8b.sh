#!/usr/bin/env bash
# Qwen3-8B pretraining at sequence length 4096 on one node of 8 devices with 64 GB each.
#
# Recipe: MindSpeed-LLM's examples/mcore/qwen3/pretrain_qwen3_8b_4K_ptd.sh (1 node x 8 NPUs, TP 1 x PP 2,
# micro-batch 1, global batch 64, lr 1.25e-6 cosine to 1.25e-7, 1% warmup, weight decay 0.1, betas 0.9/0.95,
# clip 1.0, init std 0.01, bf16, distributed optimizer with overlapped grad reduce and param gather, flash
# attention). Megatron-Bridge's qwen3_8b_pretrain_config runs TP 4 x PP 1 on 80 GB GPUs.
#
# What differs, and why: TP 2 x PP 2 x DP 2 (sequence parallel) instead of TP 1 x PP 2 x DP 4. At TP 1 the
# memory plan is 53.2 GiB on pipeline rank 0 (4.1B parameters per device: 7.6 GiB of bf16 weights, 15.3 of
# fp32 grads, 11.4 of Adam state over DP 4; two micro-batches of 18 layers in flight, 18.9), which leaves
# too little of a 64 GB device for the runtime, communicator buffers and fragmentation. The recipe also
# passes MindSpeed's own --reuse-fp32-param (bf16 weights kept inside the fp32 master copy), which
# megatron-core has not. TP 2 halves weights, grads and activations: 32.3 GiB at the peak. RoPE and SwiGLU
# fusions are megatron's defaults, RMSNorm (QK-norm included) comes from the adapter's kernel provider.
#
# Run the same command on every node, NODE_RANK 0..NNODES-1, after sourcing CANN's set_env.sh on Ascend:
#
#   DATA_PATH=/data/pile_text_document TOKENIZER_MODEL=/models/Qwen3-8B-Base CKPT_LOAD_DIR=/ckpt/qwen3-8b \
#   CKPT_SAVE_DIR=/ckpt/qwen3-8b-pt bash scripts/pretrain_qwen3_8b.sh
#
#   DRY_RUN=1 bash scripts/pretrain_qwen3_8b.sh     # the command and each device's memory; launches nothing
#
# Environment (default):
#   DATA_PATH          dataset prefix, or "WEIGHT PREFIX WEIGHT PREFIX ..." for a blend (required)
#   TOKENIZER_MODEL    Hugging Face tokenizer directory, e.g. the Qwen3-8B-Base download (required)
#   CKPT_LOAD_DIR      checkpoint to start from, e.g. from scripts/convert_checkpoint.py (none: from scratch)
#   CKPT_SAVE_DIR      where to save every SAVE_INTERVAL (2000) iterations (none: no checkpoints)
#   TENSORBOARD_DIR    tensorboard logs (none)
#   NNODES (1, the recipe's), NODE_RANK (0), NPROC_PER_NODE (8), MASTER_ADDR (localhost), MASTER_PORT (6000)
#   TRAIN_ITERS (2000), DIST_TIMEOUT_MINUTES (30), PYTHON (python3, for the plan)
#   EXTRA_ARGS         more pretrain_gpt.py arguments, appended, so they win over the ones here
#                      (e.g. "--tensor-model-parallel-size 4"); the plan sees them too
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
    --model qwen3-8b
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

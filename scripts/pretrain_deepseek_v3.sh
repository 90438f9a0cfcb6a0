#!/usr/bin/env bash
# DeepSeek-V3 (671B, 37B activated: 61 layers, the first 3 dense, multi-latent attention, 256 routed experts
# of which each token takes 8 in 4 of 8 groups, a shared expert, one multi-token prediction layer)
# pretraining at sequence length 4096 on 512 devices with 64 GB each: 64 nodes x 8 (Atlas 800T A2, or 8-GPU
# nodes), or NNODES=32 NPROC_PER_NODE=16 (Atlas A3).
#
# Recipe: MindSpeed-LLM's examples/mcore/deepseek3/pretrain_deepseek3_671b_4k_ptd.sh: 64 nodes x 8 NPUs
# (512), TP 1 x PP 8 with virtual stages of 2 layers, EP 64 (4 of the 256 experts on each device, expert DP
# 1), full recompute of every layer (the MTP layer too), micro-batch 1, global batch 7680, grouped expert
# GEMMs, all-to-all token dispatch, the distributed optimizer, flash attention, bf16. Megatron-LM's
# DeepSeek-V3 recipe (examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh) gives the router's settings:
# sequence-wise balance loss of 1e-4 beside the expert bias (DeepSeek's aux-loss-free balancing, in the
# model), the router in fp32, the MTP loss weighted 0.1.
#
# What differs, and why:
# - An uneven split of the 61 layers instead of MindSpeed's 3 no-op layers (--noop-layers, padding to 64 for
#   8 stages of 8), which megatron-core's arguments do not offer: 8 on the first stage (the 3 dense ones
#   and the embedding), 8 on each of the 6 middle ones, 5 on the last, which also holds the output layer,
#   the MTP layer (a MoE layer, its projection and norms, and its own copy of the word embedding) and both
#   losses' logits. No virtual stages: with an uneven split megatron wants each stage's layers to divide
#   into them, and 8 and 5 share no divisor. The plan is 43.5 GiB at the peak (pipeline rank 7; rank 0
#   40.4 GiB).
# - Full recompute, as MindSpeed: Megatron-LM's recipe recomputes only mlp, moe, mla_up_proj and layernorm
#   (selective), but shards every weight with Megatron-FSDP; at this layout that would be 54.1 GiB on rank 0.
# - The sequence-wise balance loss at 1e-4 and the router in fp32 (Megatron-LM's), not MindSpeed's fused
#   router options; megatron-core's "alltoall" dispatcher and --moe-permute-fusion for MindSpeed's
#   --moe-permutation-async-comm / --moe-alltoall-overlap-comm.
# - The training settings are the launchers' shared ones (lr 1.25e-6 cosine to 1.25e-7, 1% warmup, weight
#   decay 0.1, betas 0.9/0.95, clip 1.0: continued pretraining from the published checkpoint); MindSpeed's
#   lr 1e-5 with betas 0.9/0.999 go in EXTRA_ARGS where wanted.
#
# Run the same command on every node, NODE_RANK 0..NNODES-1, after sourcing CANN's set_env.sh on Ascend:
#
#   DATA_PATH=/data/pile_text_document TOKENIZER_MODEL=/models/DeepSeek-V3 \
#   CKPT_LOAD_DIR=/ckpt/deepseek-v3 CKPT_SAVE_DIR=/ckpt/deepseek-v3-pt NODE_RANK=0 MASTER_ADDR=10.0.0.1 \
#   bash scripts/pretrain_deepseek_v3.sh
#
#   DRY_RUN=1 bash scripts/pretrain_deepseek_v3.sh   # the command and each device's memory; launches nothing
#
# CKPT_LOAD_DIR: the published (FP8) checkpoint converted with scripts/convert_checkpoint.py hf-to-mcore.
#
# Environment (default):
#   DATA_PATH          dataset prefix, or "WEIGHT PREFIX WEIGHT PREFIX ..." for a blend (required)
#   TOKENIZER_MODEL    Hugging Face tokenizer directory, e.g. the DeepSeek-V3 download (required)
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
    --model deepseek-v3
    --mtp-num-layers 1
    --mtp-loss-scaling-factor 0.1
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 8
    --decoder-first-pipeline-num-layers 8
    --decoder-last-pipeline-num-layers 5
    --expert-model-parallel-size 64
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
    --max-position-embeddings 163840
    --micro-batch-size 1
    --global-batch-size 7680
)

# + checkpoints, tensorboard and EXTRA_ARGS; DRY_RUN=1: print and exit, else the plan, then torchrun
add_recipe_training_args   # the recipe's training settings, shared by the launchers
launch_or_dry_run "${ARGS[@]}"

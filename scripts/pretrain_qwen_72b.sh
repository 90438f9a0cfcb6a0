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
PYTHON="${PYTHON:-python3}"

: "${NNODES:=4}" "${NODE_RANK:=0}" "${NPROC_PER_NODE:=8}" "${MASTER_ADDR:=localhost}" "${MASTER_PORT:=6000}"
: "${TRAIN_ITERS:=2000}" "${SAVE_INTERVAL:=2000}" "${DIST_TIMEOUT_MINUTES:=30}"

# Collective-library defaults, each only where the caller has not set it; a library reads only its own, so
# one script serves both kinds of node.
: "${CUDA_DEVICE_MAX_CONNECTIONS:=1}"       # megatron's TP / sequence-parallel overlap needs in-order launches
: "${HCCL_CONNECT_TIMEOUT:=1800}"           # seconds for HCCL link set-up; the default 120 is short at 32 ranks
: "${PYTORCH_NPU_ALLOC_CONF:=expandable_segments:True}"  # less fragmentation on Ascend, as the recipe
: "${TORCH_NCCL_AVOID_RECORD_STREAMS:=1}"   # frees async collectives' tensors without recordStream delays
: "${NCCL_IB_TIMEOUT:=19}"                  # InfiniBand retry timeout for multi-node NCCL, Megatron-LM's value
export CUDA_DEVICE_MAX_CONNECTIONS HCCL_CONNECT_TIMEOUT PYTORCH_NPU_ALLOC_CONF TORCH_NCCL_AVOID_RECORD_STREAMS \
    NCCL_IB_TIMEOUT
COLLECTIVE_ENV=(CUDA_DEVICE_MAX_CONNECTIONS HCCL_CONNECT_TIMEOUT PYTORCH_NPU_ALLOC_CONF
                TORCH_NCCL_AVOID_RECORD_STREAMS NCCL_IB_TIMEOUT)

if [[ "${DRY_RUN:-0}" != 1 ]]; then
    missing=()
    [[ -n "${DATA_PATH:-}" ]] || missing+=("DATA_PATH (dataset prefix)")
    [[ -n "${TOKENIZER_MODEL:-}" ]] || missing+=("TOKENIZER_MODEL (Hugging Face tokenizer directory)")
    if ((${#missing[@]})); then
        joined="$(printf '%s, ' "${missing[@]}")"
        echo "error: set ${joined%, } before launching, or DRY_RUN=1 to only print the command and plan" >&2
        exit 2
    fi
fi

read -r -a DATA <<< "${DATA_PATH:-UNSET_DATA_PATH}"
read -r -a EXTRA <<< "${EXTRA_ARGS:-}"

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
[[ -z "${CKPT_LOAD_DIR:-}" ]] || ARGS+=(--load "$CKPT_LOAD_DIR")
[[ -z "${CKPT_SAVE_DIR:-}" ]] || ARGS+=(--save "$CKPT_SAVE_DIR" --save-interval "$SAVE_INTERVAL")
[[ -z "${TENSORBOARD_DIR:-}" ]] || ARGS+=(--tensorboard-dir "$TENSORBOARD_DIR")
ARGS+=("${EXTRA[@]}")

SCRIPT="$ROOT/scripts/pretrain_gpt.py"
LAUNCH=(torchrun --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$NPROC_PER_NODE"
        --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" "$SCRIPT" "${ARGS[@]}")

# The plan parses the same argument list, so it also refuses a layout the world size cannot hold, before any
# device is taken.
plan() {
    PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m adapter.training.memory_plan \
        --world-size "$((NNODES * NPROC_PER_NODE))" "${ARGS[@]}"
}

if [[ "${DRY_RUN:-0}" == 1 ]]; then
    echo "environment:"
    for name in "${COLLECTIVE_ENV[@]}"; do
        printf '    %s=%q\n' "$name" "${!name}"
    done
    echo "command (DRY_RUN=1: not launched):"
    # an option and its values per line, quoted where the shell needs it: the block pastes back into a shell
    quote() { if [[ "$1" =~ ^[A-Za-z0-9_./:=,+@%-]+$ ]]; then printf '%s' "$1"; else printf '%q' "$1"; fi; }
    line="${LAUNCH[0]}"
    for arg in "${LAUNCH[@]:1}"; do
        if [[ "$arg" == -* || "$arg" == "$SCRIPT" ]]; then
            printf '%s \\\n' "$line"
            line="    $(quote "$arg")"
        else
            line+=" $(quote "$arg")"
        fi
    done
    printf '%s\n\n' "$line"
    plan
    exit 0
fi

plan
exec "${LAUNCH[@]}"

# shellcheck shell=bash
# The part the cluster pretraining launchers (scripts/pretrain_qwen_72b.sh, pretrain_qwen3_*.sh) share:
# environment defaults, the collective libraries' settings, the check for DATA_PATH and TOKENIZER_MODEL,
# and the launch (scripts/launch.py: torchrun, where a preempted job that saved exits 0) with its memory
# plan, or, with DRY_RUN=1, the printed environment, command and plan.
# Sourced, not run; plain bash (4.4 or later), safe under `set -euo pipefail`. A launcher reads:
#
#   set -euo pipefail
#   ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
#   source "$ROOT/scripts/lib/cluster_launch.sh"
#   : "${NNODES:=4}"          # the model's own defaults, before cluster_defaults
#   cluster_defaults
#   require_data_env
#   ARGS=(--model ... --train-iters "$TRAIN_ITERS" --data-path "${DATA[@]}"
#         --tokenizer-model "${TOKENIZER_MODEL:-UNSET_TOKENIZER_MODEL}"
#         --distributed-timeout-minutes "$DIST_TIMEOUT_MINUTES")
#   launch_or_dry_run "${ARGS[@]}"
#
# Functions:
#   cluster_defaults      PYTHON (python3), NNODES (1), NODE_RANK (0), NPROC_PER_NODE (8), MASTER_ADDR
#                         (localhost), MASTER_PORT (6000), TRAIN_ITERS (2000), SAVE_INTERVAL (2000),
#                         DIST_TIMEOUT_MINUTES (30), MAX_RESTARTS (3: torchrun restarts every worker after a
#                         lost or hung rank, resuming from the newest checkpoint), RDZV_ID (pretrain-ADDR-PORT,
#                         the same on every node), each only where unset or empty; then the collective
#                         libraries' variables (below), exported.
#   require_data_env      without DRY_RUN=1, exits 2 with a message on stderr naming whichever of DATA_PATH
#                         and TOKENIZER_MODEL is missing; then splits DATA_PATH at blanks into the array DATA
#                         (UNSET_DATA_PATH when empty, for a dry run).
#   cluster_plan ARGS...  prints the memory plan of pretrain_gpt.py's ARGS at NNODES x NPROC_PER_NODE devices
#                         (flow.memory_plan, run by PYTHON with ROOT on PYTHONPATH); fails, as the
#                         plan does, on a layout the world size cannot hold.
#   launch_or_dry_run ARGS...
#                         appends --load CKPT_LOAD_DIR, --save CKPT_SAVE_DIR --save-interval SAVE_INTERVAL
#                         and --tensorboard-dir TENSORBOARD_DIR (each where set), then EXTRA_ARGS split at
#                         blanks (so they win), to ARGS; with DRY_RUN=1 prints the collective environment, the
#                         torchrun command (one option per line, pastes back into a shell; a c10d rendezvous at
#                         MASTER_ADDR:MASTER_PORT and --max-restarts MAX_RESTARTS) and the plan, and
#                         exits 0; otherwise prints the plan and execs the launcher on scripts/pretrain_gpt.py:
#                         PYTHON scripts/launch.py, or TORCHRUN where set (split at blanks; torchrun's arguments
#                         follow it).
#
# ROOT (the repository) must be set before sourcing; nothing here depends on the working directory.

if [[ -z "${ROOT:-}" ]]; then
    echo "error: set ROOT (the repository root) before sourcing scripts/lib/cluster_launch.sh" >&2
    exit 2
fi

# The collective libraries' variables that cluster_defaults sets and a dry run prints, in that order.
CLUSTER_COLLECTIVE_ENV=(CUDA_DEVICE_MAX_CONNECTIONS HCCL_CONNECT_TIMEOUT PYTORCH_NPU_ALLOC_CONF
                        TORCH_NCCL_AVOID_RECORD_STREAMS NCCL_IB_TIMEOUT)

cluster_defaults() {
    : "${PYTHON:=python3}"
    : "${NNODES:=1}" "${NODE_RANK:=0}" "${NPROC_PER_NODE:=8}"
    : "${MASTER_ADDR:=localhost}" "${MASTER_PORT:=6000}"
    : "${TRAIN_ITERS:=2000}" "${SAVE_INTERVAL:=2000}" "${DIST_TIMEOUT_MINUTES:=30}"
    : "${MAX_RESTARTS:=3}" "${RDZV_ID:=pretrain-$MASTER_ADDR-$MASTER_PORT}"

    # Collective-library defaults, each only where the caller has not set it; a library reads only its own,
    # so one script serves both kinds of node.
    # megatron's TP / sequence-parallel overlap needs in-order launches
    : "${CUDA_DEVICE_MAX_CONNECTIONS:=1}"
    # seconds for HCCL link set-up; the default 120 is short at 8 ranks and more
    : "${HCCL_CONNECT_TIMEOUT:=1800}"
    # less fragmentation on Ascend, as the recipes
    : "${PYTORCH_NPU_ALLOC_CONF:=expandable_segments:True}"
    # frees async collectives' tensors without recordStream delays
    : "${TORCH_NCCL_AVOID_RECORD_STREAMS:=1}"
    # InfiniBand retry timeout for multi-node NCCL, Megatron-LM's value
    : "${NCCL_IB_TIMEOUT:=19}"
    export "${CLUSTER_COLLECTIVE_ENV[@]}"
}

require_data_env() {
    if [[ "${DRY_RUN:-0}" != 1 ]]; then
        local missing=() joined
        [[ -n "${DATA_PATH:-}" ]] || missing+=("DATA_PATH (dataset prefix)")
        [[ -n "${TOKENIZER_MODEL:-}" ]] || missing+=("TOKENIZER_MODEL (Hugging Face tokenizer directory)")
        if ((${#missing[@]})); then
            joined="$(printf '%s, ' "${missing[@]}")"
            echo "error: set ${joined%, } before launching, or DRY_RUN=1 to only print the command and plan" >&2
            exit 2
        fi
    fi
    # shellcheck disable=SC2034  # DATA is the launcher's, for --data-path
    read -r -a DATA <<< "${DATA_PATH:-UNSET_DATA_PATH}"
}

# The plan parses the same argument list, so it also refuses a layout the world size cannot hold, before any
# device is taken.
cluster_plan() {
    PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m flow.memory_plan \
        --world-size "$((NNODES * NPROC_PER_NODE))" "$@"
}

# One word of the printed command: as it is where the shell reads it so, else quoted.
_cluster_quote() {
    if [[ "$1" =~ ^[A-Za-z0-9_./:=,+@%-]+$ ]]; then printf '%s' "$1"; else printf '%q' "$1"; fi
}

launch_or_dry_run() {
    local args=("$@") extra torchrun name line arg
    [[ -z "${CKPT_LOAD_DIR:-}" ]] || args+=(--load "$CKPT_LOAD_DIR")
    [[ -z "${CKPT_SAVE_DIR:-}" ]] || args+=(--save "$CKPT_SAVE_DIR" --save-interval "$SAVE_INTERVAL")
    [[ -z "${TENSORBOARD_DIR:-}" ]] || args+=(--tensorboard-dir "$TENSORBOARD_DIR")
    read -r -a extra <<< "${EXTRA_ARGS:-}"
    args+=("${extra[@]}")

    local script="$ROOT/scripts/pretrain_gpt.py"
    # torchrun's c10d rendezvous, hosted at MASTER_ADDR:MASTER_PORT, outlives a restart (a static one is torn
    # down with the failed workers); --max-restarts brings every node's workers back after a lost rank
    if [[ -n "${TORCHRUN:-}" ]]; then
        read -r -a torchrun <<< "$TORCHRUN"
    else
        torchrun=("$PYTHON" "$ROOT/scripts/launch.py")
    fi
    local launch=("${torchrun[@]}" --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$NPROC_PER_NODE"
                  --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$RDZV_ID"
                  --max-restarts "$MAX_RESTARTS" "$script" "${args[@]}")

    if [[ "${DRY_RUN:-0}" == 1 ]]; then
        echo "environment:"
        for name in "${CLUSTER_COLLECTIVE_ENV[@]}"; do
            printf '    %s=%q\n' "$name" "${!name}"
        done
        echo "command (DRY_RUN=1: not launched):"
        # an option and its values per line, quoted where the shell needs it: the block pastes back into a
        # shell
        line="$(_cluster_quote "${torchrun[0]}")"
        for arg in "${torchrun[@]:1}"; do
            line+=" $(_cluster_quote "$arg")"
        done
        for arg in "${launch[@]:${#torchrun[@]}}"; do
            if [[ "$arg" == -* || "$arg" == "$script" ]]; then
                printf '%s \\\n' "$line"
                line="    $(_cluster_quote "$arg")"
            else
                line+=" $(_cluster_quote "$arg")"
            fi
        done
        printf '%s\n\n' "$line"
        cluster_plan "${args[@]}"
        exit 0
    fi

    cluster_plan "${args[@]}"
    exec "${launch[@]}"
}

# MindSpeed-LLM's Qwen pretraining settings every launcher here shares (dropout off, init std, the LR
# schedule, AdamW, clipping, seed, data, tokenizer, logging), appended to the script's ARGS after its own;
# call it after require_data_env, which gives DATA.
add_recipe_training_args() {
    # shellcheck disable=SC2054  # "--split 100,0,0" is one word, its commas are no array separators
    ARGS+=(
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
        --exit-signal-handler  # preempted (SIGTERM): every rank finishes its iteration, saves, the job exits 0
    )
}

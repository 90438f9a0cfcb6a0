#!/usr/bin/env bash
# The GPU issue's checks on one CUDA GPU inside one call of a fixed length, ending with the goals' table
# (bench/gpu_goals.py: met, not met with the number, failed, or not run). Each step has its own time limit
# and log (LOG_DIR/STEP.log, default ./gpu-check), a line in LOG_DIR/summary.txt, and runs only while the
# run's DEADLINE (seconds, default 540) leaves it time: a step that would not fit is recorded as skipped,
# and its goals say "not run". Every benchmark run writes a torch.profiler table to LOG_DIR/profiles, a
# failing one too (its traceback above it).
#
# Steps, in the order CHECKS lists them; the default is every step, most needed first:
#   report            ADAPTER_BACKEND=cuda python -m adapter
#   cuda_tests        every test marked cuda, Liger-Kernel installed (the automatic choice is then liger)
#   dense             bench/gpu_train.py, Qwen2.5-0.5B: the flow (automatic kernels) against transformers, and
#                     the flow with the other ADAPTER_CUDA_FUSED choices and without the distributed optimizer
#   moe_large         bench/moe.py flow on two Qwen3-30B-A3B layers
#   cuda_kernels      tests/test_cuda_provider_kernels.py: each choice's kernels on the GPU against float64
#   startup           bench/startup.py: launch to the first iteration of a tiny model
#   hybrid            bench/gpu_train.py, qwen3.5-bench (2.2B, Gated DeltaNet): the flow against transformers,
#                     flash-linear-attention on both sides (its wheels in .whl/, with transformers >= 5.23)
#   cuda_tests_no_liger  the cuda tests with Liger-Kernel not installed (its wheel left off PYTHONPATH)
#   cuda_tests_fused  the tiny GPT on the GPU against the torch provider under ADAPTER_CUDA_FUSED=eager, compile
#   dense_large       bench/gpu_train.py for Qwen2.5-1.5B and Qwen3-1.7B (seq 4096, micro-batch 2)
#   moe_small         bench/moe.py flow on its small shape, and the flow with megatron's one-rank NCCL groups
#                     answered on the calling thread (ADAPTER_ONE_RANK_GROUPS=all; host-bound there, 2026-11-28)
#   suite             the quick suite on the CPU backend with xdist
#
#   bash .ci/gpu_check.sh                                          # all of it, as far as 540 s go
#   CHECKS="cuda_tests_no_liger dense_large moe_small" bash .ci/gpu_check.sh   # a second call: the rest
#   DEVICE=cpu bash .ci/gpu_check.sh    # a dry run on a CPU (tiny shapes, cuda tests skipped): no typo waits
#                                       # for the GPU
#
# Wheels the machine lacks (megatron-core's cp312 wheel, liger-kernel's; for the hybrid step
# flash-linear-attention and fla-core, and transformers >= 5.23 with the huggingface-hub, tokenizers, safetensors
# and regex it requires: docs/CI.md) in .whl/ are installed first, into /tmp/site and, for Liger,
# /tmp/site-liger (so that a step can leave it off), for flash-linear-attention /tmp/site-fla (the hybrid step's
# only, on a GPU); see shared/reference/gpu.md. .whl/ is git-ignored: the device call carries it.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
LOG_DIR="${LOG_DIR:-gpu-check}"
PYTHON="${PYTHON:-python3}"
DEADLINE="${DEADLINE:-540}"
DEVICE="${DEVICE:-cuda}"
CHECKS="${CHECKS:-report cuda_tests dense moe_large cuda_kernels startup hybrid cuda_tests_no_liger cuda_tests_fused dense_large moe_small suite}"
mkdir -p "$LOG_DIR/profiles"
: >"$LOG_DIR/summary.txt"
export PYTHONUNBUFFERED=1

install_wheels() {  # install_wheels TARGET WHEEL...: into TARGET, when there are any
    local target=$1
    shift
    [[ -e "${1:-}" ]] && "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$target" "$@"
}
if compgen -G ".whl/*.whl" >/dev/null; then
    # Liger apart so that a step can leave it off; flash-linear-attention apart because transformers' Qwen3.5
    # calls its Triton kernels, which take CUDA tensors only, wherever it is importable: the hybrid step on a
    # GPU gets it, and the CPU tests and the dry run do not.
    { install_wheels /tmp/site $(ls .whl/*.whl | grep -v -e '/liger_kernel' -e '/fla_core' -e '/flash_linear_attention')
      install_wheels /tmp/site-liger .whl/liger_kernel*.whl
      install_wheels /tmp/site-fla .whl/fla_core*.whl .whl/flash_linear_attention*.whl; } >"$LOG_DIR/wheels.log" 2>&1
fi
BASE_PATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONPATH="$BASE_PATH:/tmp/site-liger"
FLA_PATH=$PYTHONPATH
[[ $DEVICE == cuda ]] && FLA_PATH="$PYTHONPATH:/tmp/site-fla"

step() {  # step NAME LIMIT [VAR=VALUE...] COMMAND...: run with min(LIMIT, time left), log it, note status and
          # time; COMMAND may be one of the functions below (exported), VAR=VALUE its environment
    local name=$1 limit=$2 start=$SECONDS status left=$((DEADLINE - SECONDS)) assignments=()
    shift 2
    while [[ $1 == *=* ]]; do assignments+=("$1"); shift; done
    if ((left < 30)); then
        echo "$name: skipped, ${left}s left of the ${DEADLINE}s deadline" | tee -a "$LOG_DIR/summary.txt"
        return
    fi
    ((limit > left)) && limit=$left
    echo "== $name (limit ${limit}s, ${SECONDS}s so far)"
    timeout --kill-after=10 "$limit" env "${assignments[@]}" bash -c '"$@"' "$name" "$@" >"$LOG_DIR/$name.log" 2>&1
    status=$?
    tail -n 15 "$LOG_DIR/$name.log"
    echo "$name: exit $status in $((SECONDS - start))s" | tee -a "$LOG_DIR/summary.txt"
}

cuda_tests() {  # cuda_tests SETTING [PYTEST ARGS...]: the cuda tests with a junit report for gpu_goals.py
    local setting=$1
    shift
    ADAPTER_BACKEND=cpu "$PYTHON" -m pytest -q -p no:cacheprovider -n 4 --dist load --durations=10 \
        --junitxml="$LOG_DIR/cuda_tests-$setting.xml" "$@"
}

dense() {  # dense JSON MODEL-ARGS...: the flow (automatic kernels, i.e. liger with Liger-Kernel installed; the
           # other ADAPTER_CUDA_FUSED choices; without the distributed optimizer) against transformers
    local json=$1
    shift
    "$PYTHON" bench/gpu_train.py --device "$DEVICE" "$@" --steps 5 --warmup 2 --markdown --json "$json" \
        --profile "$LOG_DIR/profiles" --variants fused=eager fused=compile no-distopt
}

hybrid() {  # hybrid JSON MODEL-ARGS...: the flow against transformers on a hybrid model, no variants
    local json=$1
    shift
    "$PYTHON" bench/gpu_train.py --device "$DEVICE" "$@" --steps 5 --warmup 2 --markdown --json "$json" \
        --profile "$LOG_DIR/profiles"
}

moe() {  # moe JSON SHAPE-ARGS...: the MoE flow against transformers
    local json=$1
    shift
    "$PYTHON" bench/moe.py flow --device "$DEVICE" --rounds 1 --warmup 2 "$@" --json "$json" \
        --profile "$LOG_DIR/profiles"
}
export -f cuda_tests dense hybrid moe
export LOG_DIR PYTHON DEVICE

if [[ $DEVICE == cuda ]]; then
    DENSE_SMALL=(--models qwen2.5-0.5b) DENSE_LARGE=(--models qwen2.5-1.5b qwen3-1.7b) HYBRID=(--models qwen3.5-bench)
    MOE_LARGE=(--shape qwen3-30b-a3b --iters 3) MOE_SMALL=(--shape small --iters 4 --variants one-rank-groups=all)
    { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; } 2>&1 | tee "$LOG_DIR/device.txt"
else  # the dry run: every command once, at sizes a CPU runs in seconds
    DENSE_SMALL=(--tiny) DENSE_LARGE=(--tiny) HYBRID=(--models qwen3.5-tiny) MOE_LARGE=(--shape tiny --iters 2)
    MOE_SMALL=(--shape tiny --iters 2 --variants one-rank-groups=all)
fi
"$PYTHON" -c 'import torch, megatron.core as m; print("torch", torch.__version__, "cuda", torch.version.cuda,
    torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU", "megatron-core", m.__version__)' \
    2>&1 | tee -a "$LOG_DIR/device.txt"

for check in $CHECKS; do
    case $check in
        report) step report 60 ADAPTER_BACKEND="$DEVICE" "$PYTHON" -m adapter ;;
        cuda_tests) step cuda_tests 180 cuda_tests liger -m cuda tests ;;
        cuda_kernels) step cuda_kernels 90 cuda_tests kernels tests/test_cuda_provider_kernels.py ;;
        dense) step dense 240 dense "$LOG_DIR/dense.json" "${DENSE_SMALL[@]}" ;;
        hybrid) step hybrid 200 PYTHONPATH="$FLA_PATH" hybrid "$LOG_DIR/dense-hybrid.json" "${HYBRID[@]}" ;;
        moe_large) step moe_large 200 moe "$LOG_DIR/moe-qwen3-30b-a3b.json" "${MOE_LARGE[@]}" ;;
        startup) step startup 90 "$PYTHON" bench/startup.py --device "$DEVICE" --rounds 1 --markdown \
            --json "$LOG_DIR/startup.json" ;;
        cuda_tests_no_liger) step cuda_tests_no_liger 200 PYTHONPATH="$BASE_PATH" cuda_tests no-liger -m cuda tests ;;
        cuda_tests_fused) for choice in eager compile; do
                step "cuda_tests_fused_$choice" 90 ADAPTER_CUDA_FUSED=$choice cuda_tests "fused-$choice" -m cuda \
                    tests/test_markers.py::test_tiny_gpt_on_the_device_matches_the_torch_provider
            done ;;
        dense_large) step dense_large 300 dense "$LOG_DIR/dense-large.json" "${DENSE_LARGE[@]}" ;;
        moe_small) step moe_small 150 moe "$LOG_DIR/moe-small.json" "${MOE_SMALL[@]}" ;;
        suite) step suite 220 ADAPTER_BACKEND=cpu "$PYTHON" -m pytest -q -p no:cacheprovider \
            -m "not npu and not slow and not cuda" -n "${SUITE_WORKERS:-12}" --durations=10 ;;
        *) echo "unknown check $check" | tee -a "$LOG_DIR/summary.txt" ;;
    esac
done
cat "$LOG_DIR/summary.txt"
"$PYTHON" bench/gpu_goals.py "$LOG_DIR"

#!/usr/bin/env bash
# The gpu job's checks on one CUDA GPU, inside one call of a fixed length. Each step has its own time limit
# and log (LOG_DIR/STEP.log, default ./gpu-check), a summary line in LOG_DIR/summary.txt, and runs only
# while the whole run's DEADLINE (seconds, default 540) leaves it time: a step that would not fit is
# recorded as skipped, so the summary always comes back.
#
# Steps, run in the order CHECKS lists them (default: report cuda_tests startup suite):
#   report      ADAPTER_BACKEND=cuda python -m adapter
#   cuda_tests  every test marked cuda (ranks that use the GPU start in fresh interpreters)
#   startup     bench/startup.py --device cuda: launch to the first iteration against imports alone
#   dense       bench/gpu_train.py: the flow against transformers, Qwen2.5-0.5B and 1.5B (DENSE_MODELS),
#               with torch.profiler tables in LOG_DIR/profiles
#   moe         bench/moe.py flow on its small shape and on two Qwen3-30B-A3B layers, with profiles
#   kernels     bench/kernels.py --device cuda
#   suite       the quick suite on the CPU backend with xdist
#
#   bash .ci/gpu_check.sh                                        # correctness, about 6 minutes on an H200
#   CHECKS="cuda_tests startup dense moe" bash .ci/gpu_check.sh  # the performance checks of issue 26
#
# Wheels the machine lacks (megatron-core's cp312 wheel, liger-kernel) in .whl/ are installed first into
# a folder on PYTHONPATH; see shared/reference/gpu.md.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
LOG_DIR="${LOG_DIR:-gpu-check}"
PYTHON="${PYTHON:-python3}"
DEADLINE="${DEADLINE:-540}"
CHECKS="${CHECKS:-report cuda_tests startup suite}"
DENSE_MODELS="${DENSE_MODELS:-qwen2.5-0.5b qwen2.5-1.5b}"
mkdir -p "$LOG_DIR/profiles"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

if compgen -G ".whl/*.whl" >/dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
        >"$LOG_DIR/wheels.log" 2>&1 && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

step() {  # step NAME LIMIT COMMAND...: run with min(LIMIT, time left), log it, note status and time
    local name=$1 limit=$2 start=$SECONDS status left=$((DEADLINE - SECONDS))
    shift 2
    if ((left < 30)); then
        echo "$name: skipped, ${left}s left of the ${DEADLINE}s deadline" | tee -a "$LOG_DIR/summary.txt"
        return
    fi
    ((limit > left)) && limit=$left
    echo "== $name (limit ${limit}s, ${SECONDS}s so far)"
    timeout --kill-after=10 "$limit" "$@" >"$LOG_DIR/$name.log" 2>&1
    status=$?
    tail -n 20 "$LOG_DIR/$name.log"
    echo "$name: exit $status in $((SECONDS - start))s" | tee -a "$LOG_DIR/summary.txt"
}

{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    "$PYTHON" -c 'import torch, megatron.core as m; print("torch", torch.__version__, "cuda", torch.version.cuda,
        torch.cuda.get_device_name(), "megatron-core", m.__version__)'
} 2>&1 | tee "$LOG_DIR/device.txt"

for check in $CHECKS; do
    case $check in
        report) step report 60 env ADAPTER_BACKEND=cuda "$PYTHON" -m adapter ;;
        cuda_tests) step cuda_tests 240 env ADAPTER_BACKEND=cpu "$PYTHON" -m pytest -q -p no:cacheprovider -m cuda \
            --durations=15 tests ;;
        startup) step startup 90 "$PYTHON" bench/startup.py --device cuda --rounds 1 --markdown ;;
        dense) step dense 270 "$PYTHON" bench/gpu_train.py --device cuda --models $DENSE_MODELS --steps 5 --warmup 2 \
            --markdown --profile "$LOG_DIR/profiles" ;;
        moe) step moe 200 bash -c "$PYTHON bench/moe.py flow --device cuda --rounds 1 --iters 4 --warmup 2 \
            --profile $LOG_DIR/profiles && $PYTHON bench/moe.py flow --device cuda --shape qwen3-30b-a3b --rounds 1 \
            --iters 3 --warmup 2 --profile $LOG_DIR/profiles" ;;
        kernels) step kernels 100 "$PYTHON" bench/kernels.py --device cuda --markdown --repeats 5 ;;
        suite) step suite 220 env ADAPTER_BACKEND=cpu "$PYTHON" -m pytest -q -p no:cacheprovider \
            -m "not npu and not slow and not cuda" -n "${SUITE_WORKERS:-12}" --durations=10 ;;
        *) echo "unknown check $check (report cuda_tests startup dense moe kernels suite)" | tee -a "$LOG_DIR/summary.txt" ;;
    esac
done
cat "$LOG_DIR/summary.txt"

#!/usr/bin/env bash
# The gpu job's checks on one CUDA GPU, in a fixed time: the report, the cuda tests, the kernel and MoE
# benchmarks, a tiny dense and a tiny MoE pretrain (one rank; NCCL takes one rank per GPU) with a resume,
# then the quick suite. Each step has its own time limit, so one that hangs costs only its own share;
# every step's output goes to LOG_DIR (default ./gpu-check) as STEP.log, and a summary line per step
# to LOG_DIR/summary.txt.
#
#   bash .ci/gpu_check.sh                 # in the repository root, with megatron-core importable
#   SKIP_SUITE=1 bash .ci/gpu_check.sh    # everything but the quick suite (SKIP_KERNELS: the kernel bench)
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
LOG_DIR="${LOG_DIR:-gpu-check}"
PYTHON="${PYTHON:-python3}"
mkdir -p "$LOG_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
RUN_DIR="$(mktemp -d)"

step() {  # step NAME SECONDS COMMAND...: run with a limit, log it, note status and time
    local name=$1 limit=$2 start=$SECONDS status
    shift 2
    echo "== $name (limit ${limit}s, ${SECONDS}s so far)"
    timeout --kill-after=10 "$limit" "$@" >"$LOG_DIR/$name.log" 2>&1
    status=$?
    tail -n 25 "$LOG_DIR/$name.log"
    echo "$name: exit $status in $((SECONDS - start))s" | tee -a "$LOG_DIR/summary.txt"
}

pretrain() {  # pretrain MODEL ITERS EXTRA...: one rank on the GPU, mock data, bf16, saving at the end
    local model=$1 iters=$2
    shift 2
    ADAPTER_BACKEND=cuda "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node 1 \
        scripts/pretrain_gpt.py --model "$model" --bf16 --micro-batch-size 4 --global-batch-size 16 \
        --seq-length 64 --train-iters "$iters" --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine \
        --lr-warmup-iters 10 --clip-grad 1.0 --mock-data --eval-interval 1000 --eval-iters 0 --log-interval 10 \
        --save "$RUN_DIR/$model" --load "$RUN_DIR/$model" --save-interval 1000 --seed 1234 "$@"
}

{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    "$PYTHON" -c 'import torch, megatron.core as m; print("torch", torch.__version__, "cuda", torch.version.cuda,
        torch.cuda.get_device_name(), "megatron-core", m.__version__)'
} 2>&1 | tee "$LOG_DIR/device.txt"

step report 60 env ADAPTER_BACKEND=cuda "$PYTHON" -m adapter
step cuda_tests 120 env ADAPTER_BACKEND=cpu "$PYTHON" -m pytest -q -p no:cacheprovider -m cuda \
    tests/test_markers.py tests/test_report.py
if [[ -z "${SKIP_KERNELS:-}" ]]; then
    step kernels 100 "$PYTHON" bench/kernels.py --device cuda --markdown --repeats 5
fi
step pretrain_dense 90 bash -c "$(declare -f pretrain); PYTHON=$PYTHON; RUN_DIR=$RUN_DIR;
    pretrain qwen2.5-tiny 60 --exit-interval 40 && pretrain qwen2.5-tiny 60"
step pretrain_moe 90 bash -c "$(declare -f pretrain); PYTHON=$PYTHON; RUN_DIR=$RUN_DIR;
    pretrain gpt-tiny-moe 60 --exit-interval 40 --moe-grouped-gemm --moe-token-dispatcher-type alltoall \
        --moe-permute-fusion --moe-aux-loss-coeff 1e-2 &&
    pretrain gpt-tiny-moe 60 --moe-grouped-gemm --moe-token-dispatcher-type alltoall --moe-permute-fusion \
        --moe-aux-loss-coeff 1e-2"
step moe_bench 150 "$PYTHON" bench/moe.py all --device cuda --rounds 2
if [[ -z "${SKIP_SUITE:-}" ]]; then
    step quick_suite "${SUITE_LIMIT:-120}" env ADAPTER_BACKEND=cpu "$PYTHON" -m pytest -q -p no:cacheprovider \
        -m "not npu and not slow" -n "${SUITE_WORKERS:-12}" --durations=10
fi
rm -rf "$RUN_DIR"
cat "$LOG_DIR/summary.txt"

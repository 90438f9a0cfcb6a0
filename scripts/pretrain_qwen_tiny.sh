#!/usr/bin/env bash
# The tiny Qwen on any machine: prepares the shipped sample corpus (a 512-piece sentencepiece model trained
# on it, then Megatron .bin/.idx), and trains qwen2.5-tiny with TP 2 x PP 2 on 4 processes (gloo on a CPU;
# NCCL or HCCL where there are devices), evaluating as it goes and saving at the end. MODEL=qwen3-tiny trains
# the Qwen3 flavor the same way (heads of their own size, QK-norm). MODEL=qwen3-moe-tiny (or any MoE model of
# models.names(), such as gpt-tiny-moe) trains a Mixture of Experts instead: PP 2, the experts over EP 2
# (the rest data parallel over 2), megatron's grouped experts and all-to-all dispatcher, and the router's
# load-balancing loss at the model's published coefficient (qwen3-moe-tiny's 1e-3, as Qwen3-MoE's), or 1e-2
# (Megatron-LM's suggested start) for a model published without one.
#
#   bash scripts/pretrain_qwen_tiny.sh                        # 300 iterations into ./qwen-tiny-run
#   EXIT_INTERVAL=150 bash scripts/pretrain_qwen_tiny.sh      # stop (and save) at 150 ...
#   bash scripts/pretrain_qwen_tiny.sh                        # ... and this run resumes there
#   MODEL=qwen3-moe-tiny bash scripts/pretrain_qwen_tiny.sh   # the MoE model into ./qwen3-moe-tiny-run
#
# Environment (default): MODEL (qwen2.5-tiny), OUTPUT_DIR (./qwen-tiny-run, ./MODEL-run for another model:
# data, checkpoints, tensorboard), TRAIN_ITERS (300), EVAL_INTERVAL (50), EXIT_INTERVAL (none), PYTHON
# (python3), MAX_RESTARTS (0: how often torchrun brings the 4 processes back after one is lost or hangs; each
# restart resumes from the newest checkpoint), EXTRA_ARGS (appended to the arguments). SIGTERM (Ctrl-C is
# SIGINT) stops it after the iteration in flight, saved, with exit status 0 (scripts/launch.py).
# A run finds its checkpoint in OUTPUT_DIR/checkpoints and continues from it; delete the folder to restart.
# scripts/plot_loss.py OUTPUT_DIR/tensorboard draws the curves.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
: "${MODEL:=qwen2.5-tiny}" "${TRAIN_ITERS:=300}" "${EVAL_INTERVAL:=50}"
if [[ "$MODEL" == qwen2.5-tiny ]]; then : "${OUTPUT_DIR:=qwen-tiny-run}"; else : "${OUTPUT_DIR:=$MODEL-run}"; fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # 4 processes share the cores: one thread each

# a MoE model (the named config has experts; this prints its aux-loss coefficient): PP 2 x EP 2; otherwise
# (or a name that is no model, which pretrain_gpt.py then refuses) TP 2 x PP 2 with sequence parallelism
AUX_LOSS_COEFF="$(PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -c "import sys, models
model = models.get(sys.argv[1])
if model.num_experts is not None:
    print(model.moe_aux_loss_coeff or 1e-2)" "$MODEL" 2>/dev/null || true)"
if [[ -n "$AUX_LOSS_COEFF" ]]; then
    LAYOUT=(--pipeline-model-parallel-size 2 --expert-model-parallel-size 2 --moe-grouped-gemm
            --moe-token-dispatcher-type alltoall --moe-aux-loss-coeff "$AUX_LOSS_COEFF")
else
    LAYOUT=(--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel)
fi

mkdir -p "$OUTPUT_DIR"
if [[ ! -f "$OUTPUT_DIR/data/tokenizer.model" ]]; then
    PREFIX="$("$PYTHON" "$ROOT/scripts/prepare_sample_data.py" "$OUTPUT_DIR/data")"
else
    PREFIX="$OUTPUT_DIR/data/sample_text_document"
fi

read -r -a EXTRA <<< "${EXTRA_ARGS:-}"
ARGS=(
    --model "$MODEL" "${LAYOUT[@]}"
    --use-distributed-optimizer --overlap-grad-reduce
    --micro-batch-size 4 --global-batch-size 16 --seq-length 64
    --train-iters "$TRAIN_ITERS" --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 20
    --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 --hidden-dropout 0 --attention-dropout 0
    --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model "$OUTPUT_DIR/data/tokenizer.model"
    --data-path "$PREFIX" --split 949,50,1 --no-create-attention-mask-in-dataloader
    --eval-interval "$EVAL_INTERVAL" --eval-iters 5 --log-interval 25
    --save "$OUTPUT_DIR/checkpoints" --load "$OUTPUT_DIR/checkpoints" --save-interval "$TRAIN_ITERS"
    --exit-signal-handler
    --tensorboard-dir "$OUTPUT_DIR/tensorboard" --seed 1234
)
if [[ -n "${EXIT_INTERVAL:-}" ]]; then
    ARGS+=(--exit-interval "$EXIT_INTERVAL")
fi

exec "$PYTHON" "$ROOT/scripts/launch.py" --standalone --nproc_per_node 4 --max-restarts "${MAX_RESTARTS:-0}" \
    "$ROOT/scripts/pretrain_gpt.py" "${ARGS[@]}" ${EXTRA[@]+"${EXTRA[@]}"}

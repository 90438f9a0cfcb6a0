"""The fsdp_dtensor checkpoint that tests/test_flow_resume.py resumes through scripts/pretrain_gpt.py: its
run's arguments and where it is kept.

The project's own training loop (adapter/training's ``pretrain``, since removed for the one flow) recorded it
with Megatron-FSDP under megatron-core 0.19.2 in commit 501a4ae, with ``python -m tests.own_flow_checkpoint`` as
that commit has it: 8 iterations of a 1-layer GPT of hidden size 32 at DP2 (Megatron-FSDP, the distributed
optimizer) on 2 gloo ranks, saved at 4 and 8. The checkpoint of iteration 4 is kept in
tests/data/checkpoint-own-fsdp_dtensor/ with run.json beside it: the arguments and the losses of all 8
iterations. The small model keeps it under 1 MB. It is data, not recorded again: the loop that made it is gone,
and the one flow resumes it (the point of keeping it).
"""

from __future__ import annotations

import json
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data" / "checkpoint-own-fsdp_dtensor"
SAVED_AT, ITERS = 4, 8
# the own loop's NullTokenizer holds --vocab-size entries and the end-of-document id after them: 128 in all
ARGV = ["--num-layers", "1", "--hidden-size", "32", "--ffn-hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--normalization", "RMSNorm", "--swiglu",
        "--position-embedding-type", "rope", "--disable-bias-linear", "--vocab-size", "127",
        "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", str(ITERS), "--lr", "3e-3",
        "--min-lr", "3e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--mock-data",
        "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "0", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--seed", "7", "--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor"]


def recorded() -> dict:
    """run.json: megatron_core, torch, argv, saved_at, and "lm loss" by iteration (keys as ints)."""
    run = json.loads((DATA / "run.json").read_text())
    return {**run, "lm loss": {int(i): loss for i, loss in run["lm loss"].items()}}

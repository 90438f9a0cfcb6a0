"""The fsdp_dtensor checkpoint that tests/test_flow_resume.py resumes through scripts/pretrain_gpt.py: saved by
the project's own training loop (adapter/training, today's flow, kept as bench/pretrain_gpt_own.py) with
Megatron-FSDP, its run's arguments, where it is kept, and how it is recorded again.

``python -m tests.own_flow_checkpoint`` records it. It runs 8 iterations of a 1-layer GPT of hidden size 32 at DP2
(Megatron-FSDP, the distributed optimizer) on 2 gloo ranks and saves at 4 and 8. It keeps the checkpoint of
iteration 4 in tests/data/checkpoint-own-fsdp_dtensor/ and writes run.json beside it with the arguments and the
losses of all 8 iterations. The small model keeps it under 1 MB.
"""

from __future__ import annotations

import importlib.metadata
import json
import shutil
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


def record(directory: Path) -> None:
    """Train and save as the module says, into ``directory``; written beside it and moved in only when
    complete, so a failed run leaves the previous recording as it was."""
    from tests.distributed import run_ranks
    from tests.pretrain_ranks import logged_losses, run_pretrain

    partial = directory.with_name(directory.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    results = run_ranks(2, run_pretrain, [*ARGV, "--save", str(partial), "--save-interval", str(SAVED_AT)])
    shutil.rmtree(partial / f"iter_{ITERS:07d}")
    (partial / "latest_checkpointed_iteration.txt").write_text(str(SAVED_AT))
    run = {"megatron_core": importlib.metadata.version("megatron-core"), "torch": importlib.metadata.version("torch"),
           "argv": ARGV, "saved_at": SAVED_AT, "lm loss": logged_losses(results)}
    (partial / "run.json").write_text(json.dumps(run, indent=1) + "\n")
    shutil.rmtree(directory, ignore_errors=True)
    partial.rename(directory)


if __name__ == "__main__":
    record(DATA)

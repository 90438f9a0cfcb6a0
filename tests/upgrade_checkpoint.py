"""The checkpoint that tests/test_checkpoint_upgrade.py resumes across a megatron-core upgrade: its run's
arguments, where it is kept, and how it is recorded again.

``python -m tests.upgrade_checkpoint`` records it, under megatron-core 0.16.1 only. It runs 8 iterations of a
2-layer qwen2.5-tiny at TP2 on 2 gloo ranks and saves at 4 and 8. It keeps the checkpoint of iteration 4 in
tests/data/checkpoint-0.16.1/ and writes run.json beside it with the arguments and the losses of all 8
iterations. Two layers keep it at about 2.3 MB.
"""

from __future__ import annotations

import importlib.metadata
import json
import shutil
import sys
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data" / "checkpoint-0.16.1"
RECORDED_WITH = "0.16.1"
SAVED_AT, ITERS = 4, 8


def argv(tp: int, *extra: str) -> list[str]:
    """The recorded run's arguments at tensor-parallel size ``tp`` (data parallel takes the other ranks): mock
    data, the distributed optimizer over several buckets (--ddp-bucket-size 4096), no dropout."""
    return ["--model", "qwen2.5-tiny", "--num-layers", "2", "--tensor-model-parallel-size", str(tp),
            "--micro-batch-size", "2", "--global-batch-size", "8", "--seq-length", "32", "--train-iters", str(ITERS),
            "--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
            "--mock-data", "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "0",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--use-distributed-optimizer",
            "--ddp-bucket-size", "4096", "--seed", "7", *extra]




def recorded() -> dict:
    """run.json: megatron_core, torch, argv, saved_at, and "lm loss" by iteration (keys as ints)."""
    run = json.loads((DATA / "run.json").read_text())
    return {**run, "lm loss": {int(i): loss for i, loss in run["lm loss"].items()}}


def record(directory: Path) -> None:
    """Train and save as the module says, into ``directory``. The files are written beside it and moved in
    only when complete, so a failed run leaves the previous recording as it was."""
    from tests.distributed import run_ranks
    from tests.pretrain_ranks import logged_losses, run_pretrain

    installed = importlib.metadata.version("megatron-core")
    if installed != RECORDED_WITH:
        sys.exit(f"error: megatron-core {installed} is installed; the checkpoint is recorded with {RECORDED_WITH}")
    partial = directory.with_name(directory.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    results = run_ranks(2, run_pretrain, [*argv(2), "--save", str(partial), "--save-interval", str(SAVED_AT)])
    shutil.rmtree(partial / f"iter_{ITERS:07d}")
    (partial / "latest_checkpointed_iteration.txt").write_text(str(SAVED_AT))
    run = {"megatron_core": installed, "torch": importlib.metadata.version("torch"), "argv": argv(2),
           "saved_at": SAVED_AT, "lm loss": logged_losses(results)}
    (partial / "run.json").write_text(json.dumps(run, indent=1) + "\n")
    shutil.rmtree(directory, ignore_errors=True)
    partial.rename(directory)


if __name__ == "__main__":
    record(DATA)

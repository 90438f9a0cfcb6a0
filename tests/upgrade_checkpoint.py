"""The checkpoint that tests/test_flow_resume.py resumes across a megatron-core upgrade (and
tests/test_checkpoint_upgrade.py inspects): its run's arguments and where it is kept.

The project's own training loop (adapter/training's ``pretrain``, since removed for the one flow) recorded it
under megatron-core 0.16.1 in commit dac7c82, with ``python -m tests.upgrade_checkpoint`` as that commit has
it: 8 iterations of a 2-layer qwen2.5-tiny at TP2 on 2 gloo ranks, saved at 4 and 8. The checkpoint of
iteration 4 is kept in tests/data/checkpoint-0.16.1/ with run.json beside it: the arguments and the losses of
all 8 iterations. Two layers keep it at about 2.3 MB. It is data, not recorded again: the loop that made it
is gone, and the one flow resumes it (the point of keeping it).
"""

from __future__ import annotations

import json
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

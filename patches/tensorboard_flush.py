"""The last evaluation's TensorBoard scalars are written before the run ends.

megatron.training flushes its TensorBoard writer at the end of ``train``; ``pretrain`` then evaluates the
validation and test sets and returns, and the process exits. Those scalars wait in the writer's queue (flushed
every 120 s) and are lost unless its thread happened to write them first: of two runs of the same flags, one
kept the test set's loss and the other did not (tests/test_one_flow_entry_points.py, 2026-12-07). Flushed here
once ``pretrain`` returns or stops, for Megatron-LM's scripts through ``adapter.run`` as for the project's.
"""

from __future__ import annotations

import functools


def flushed_at_the_end(pretrain):
    """``pretrain``; its TensorBoard writer (the last rank's, where there is one) flushed when it ends."""

    @functools.wraps(pretrain)
    def run(*args, **kwargs):
        try:
            return pretrain(*args, **kwargs)
        finally:
            from megatron.training.global_vars import get_tensorboard_writer

            writer = get_tensorboard_writer()
            if writer is not None:
                writer.flush()

    return run


def register(registry, versions: str) -> None:
    registry.wrap("megatron.training.training:pretrain", flushed_at_the_end, versions=versions,
                  reason="the validation and test scalars pretrain writes after train's flush are lost at exit")

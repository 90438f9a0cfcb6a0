"""Rank functions of the flow's sharded data-parallel tests: ``pretrain`` (scripts/pretrain_gpt.py's step, as
tests/pretrain_ranks.py runs it), reporting beside its history the data-parallel wrapper the flow built and the
bytes this rank holds after training (tests/sharding_ranks.py's measures)."""

from __future__ import annotations

from adapter import kernels
from adapter.training import pretrain as flow
from tests.pretrain_ranks import run_pretrain
from tests.sharding_ranks import _fsdp2_bytes, _held_bytes


def run_pretrain_measured(argv: list[str]) -> dict:
    """As run_pretrain, with ``wrapper`` (the first chunk's class), the kernel provider that ran and this rank's
    parameter, gradient and optimizer-state bytes."""
    built = []
    setup = flow.setup_model_and_optimizer

    def kept_setup(*args, **kwargs):
        built.append(setup(*args, **kwargs))
        return built[-1]

    flow.setup_model_and_optimizer = kept_setup
    history = run_pretrain(argv)
    [chunk, *_], optimizer, _ = built[0]
    wrapper = type(chunk).__name__
    held = (_fsdp2_bytes if wrapper == "TorchFullyShardedDataParallel" else _held_bytes)(chunk, optimizer)
    return {**history, "wrapper": wrapper, "kernels": kernels.current().__name__.rpartition(".")[2], **held}

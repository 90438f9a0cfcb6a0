"""Rank functions of the flow's sharded data-parallel tests: scripts/pretrain_gpt.py's ``pretrain``
(megatron.training's, as tests/flow_ranks.py runs it), reporting beside its history the data-parallel wrapper
the flow built and the bytes this rank holds after training (tests/sharding_ranks.py's measures)."""

from __future__ import annotations

from adapter import kernels
from tests.flow_ranks import run_pretrain_keeping_setup
from tests.sharding_ranks import _fsdp2_bytes, _held_bytes


def run_pretrain_measured(argv: list[str]) -> dict:
    """As run_pretrain, with ``wrapper`` (the first chunk's class), the kernel provider that ran and this rank's
    parameter, gradient and optimizer-state bytes."""
    history, ([chunk, *_], optimizer, _) = run_pretrain_keeping_setup(argv)
    wrapper = type(chunk).__name__
    held = (_fsdp2_bytes if wrapper == "TorchFullyShardedDataParallel" else _held_bytes)(chunk, optimizer)
    return {**history, "wrapper": wrapper, "kernels": kernels.current().__name__.rpartition(".")[2], **held}

"""torch_dist checkpoints the project's earlier loop (removed) saved before it wrote megatron's ``args``, resumed by
megatron.training as that loop resumed them (``adapter/earlier_checkpoints.py``). The megatron-core wheel has
megatron.training from 0.17; on 0.16.1 the target stays pending until a Megatron-LM checkout is imported."""

from __future__ import annotations

from adapter import earlier_checkpoints


def register(registry, versions: str) -> None:
    registry.wrap("megatron.training.checkpointing:_load_base_checkpoint", earlier_checkpoints.read_as_megatron_reads,
                  versions=versions, reason="reads a checkpoint without args as TP1 with no consumed samples and "
                                            "dp_zero_gather_scatter optimizer state; the flow's earlier ones are "
                                            "not")

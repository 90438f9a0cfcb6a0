"""Fine-grained activation offloading off CUDA, the registry entries (the implementation and why:
``adapter/activation_offload.py``)."""

from __future__ import annotations

from adapter import activation_offload

_OFFLOAD = "megatron.core.pipeline_parallel.fine_grained_activation_offload"


def register(registry, versions: str) -> None:
    registry.replace(f"{_OFFLOAD}:ChunkOffloadHandler._can_manage_tensor_for_offload", activation_offload.can_manage,
                     versions=versions, backends=("cpu", "npu"), optional=True,
                     reason="megatron offloads only tensors on 'cuda': off CUDA, those on this backend's device")
    registry.bind("megatron.core.extensions.transformer_engine:cpu_offload", activation_offload.TE_FLAG,
                  versions=versions, backends=("cpu", "npu"),
                  reason="the offload context sets TE's flag for TE's layers; without TE none reads it")

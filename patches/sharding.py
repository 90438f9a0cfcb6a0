"""Sharded data parallelism off CUDA, the registry entries: the DeviceMesh that Megatron-FSDP's adapter and
its checkpoint's validation build on ``"cuda"`` is built on this backend's device type; NCCL's pre-multiplied
sum is a scale and a sum; the fsdp_dtensor optimizer state names every parameter on every rank, as with TE's
FusedAdam, so its save and load issue the same collectives on every rank (``adapter/sharding.py``)."""

from __future__ import annotations

from adapter import sharding

OFF_CUDA = ("cpu", "npu")
_FSDP_BUFFER = "megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer"
MESH_USERS = ("megatron.core.distributed.fsdp.mcore_fsdp_adapter", "megatron.core.transformer.fsdp_dtensor_checkpoint")


def register(registry, versions: str) -> None:
    for module in MESH_USERS:
        registry.replace(f"{module}:DeviceMesh", sharding.RoutedDeviceMesh, versions=versions, backends=OFF_CUDA,
                         rebind_copies=False,
                         reason="the FSDP device mesh is built on 'cuda'; DTensor puts shards on the mesh's device")
    registry.wrap(f"{_FSDP_BUFFER}:gradient_reduce_preprocessing", sharding.scaled_before_sum, versions=versions,
                  backends=OFF_CUDA, reason="NCCL's pre-multiplied sum: gloo and HCCL sum the scaled gradients")
    registry.wrap("megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.sharded_param_state_fsdp_dtensor",
                  sharding.every_shard_in_optimizer_state, versions=versions,
                  reason="torch's AdamW has no state for an empty shard; megatron_fsdp gathers once per DTensor")
    registry.wrap("megatron.training.arguments:validate_args", sharding.refuse_unready_fsdp, versions=versions,
                  backends=OFF_CUDA, reason="Megatron-FSDP without einops: one line, not an assert per rank")

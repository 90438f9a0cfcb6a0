"""Sharded data parallelism off CUDA, the registry entries: the DeviceMesh that Megatron-FSDP's adapter and
its checkpoint's validation, and megatron's torch FSDP2 wrapper, build on ``"cuda"`` is built on this backend's
device type; NCCL's pre-multiplied sum is a scale and a sum; the fsdp_dtensor optimizer state names every
parameter on every rank, as with TE's FusedAdam, so its save and load issue the same collectives on every rank;
the SwiGLU split of that checkpoint finds its parameters in the MegatronFSDP module Megatron-LM hands it;
FSDP2's torch_dist save and resume (``adapter/sharding.py``)."""

from __future__ import annotations

from adapter import sharding

OFF_CUDA = ("cpu", "npu")
_FSDP_BUFFER = "megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer"
MESH_USERS = ("megatron.core.distributed.fsdp.mcore_fsdp_adapter", "megatron.core.transformer.fsdp_dtensor_checkpoint")
TORCH_FSDP2 = "megatron.core.distributed.torch_fully_sharded_data_parallel"


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
    # every supported release has the lookup (0.16.1 .. 0.19.2; upstream main too): all of `versions`
    registry.wrap("megatron.core.transformer.fsdp_dtensor_checkpoint:handle_swiglu_in_state_dict",
                  sharding.swiglu_split_finds_its_parameters, versions=versions,
                  reason="Megatron-LM hands the SwiGLU split MegatronFSDP, whose names lack a 'module.' it adds")
    registry.wrap("megatron.training.arguments:validate_args", sharding.fsdp_requirements_in_one_line,
                  versions=versions, backends=OFF_CUDA,
                  reason="Megatron-LM's FSDP assertions (untied embeddings, fsdp_dtensor) and Megatron-FSDP without "
                         "einops: one line for the job, not an assert per rank")
    _register_torch_fsdp2(registry, versions)


def _register_torch_fsdp2(registry, versions: str) -> None:
    """torch FSDP2 through megatron (``--use-torch-fsdp2``): the wrapper's mesh on this backend's device; its
    torch_dist save and resume (on every backend: torch 2.13 and Megatron-LM's in-place load, not the device)."""
    registry.replace(f"{TORCH_FSDP2}:DeviceMesh", sharding.RoutedDeviceMesh, versions=versions, backends=OFF_CUDA,
                     rebind_copies=False,
                     reason="torch FSDP2's mesh is built on 'cuda'; fully_shard puts shards on the mesh's device")
    registry.replace("megatron.core.dist_checkpointing.optimizer:get_optim_param_to_id_map", sharding.local_shard_ids,
                     versions=versions,
                     reason="FSDP2's Parameter(DTensor).to_local() is a fresh view in torch 2.13: map local shards")
    registry.wrap("megatron.training.checkpointing:load_checkpoint", sharding.fsdp2_resumes_adam_step,
                  versions=versions,
                  reason="FSDP2's in-place torch_dist load skips load_state_dict: torch Adam's step restored")

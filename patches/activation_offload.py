"""Fine-grained activation offloading off CUDA, the registry entries (the implementation and why:
``adapter/activation_offload.py``), and what Megatron-LM's flow asks of it besides megatron-core:

- ``validate_args`` asserts ``--transformer-impl transformer_engine``; megatron-core's offload manager runs
  the local spec as well (tests/test_activation_offload.py), so off CUDA the check is answered for it (the
  flag hidden from ``validate_args`` for the call and restored), with one line;
- ``pretrain`` then binds the process's CPUs to the NVIDIA GPU's NUMA node through cuda-python and NVML
  (``set_ideal_affinity_for_current_gpu``), a tuning of host-device copies with no NVIDIA GPU to ask off
  CUDA: there it leaves the affinity as the launcher set it.
"""

from __future__ import annotations

import functools

from adapter import activation_offload
from patches.megatron_lm_recipes import validated_with_flag_hidden

_OFFLOAD = "megatron.core.pipeline_parallel.fine_grained_activation_offload"
OFF_CUDA = ("cpu", "npu")


def offloading_without_transformer_engine(validate_args):
    """``--fine-grained-activation-offloading`` without TE (the local spec runs) passes Megatron-LM's TE-only
    check."""

    @functools.wraps(validate_args)
    def validate(args, *rest, **kwargs):
        from megatron.core.extensions import transformer_engine

        if not getattr(args, "fine_grained_activation_offloading", False) or transformer_engine.HAVE_TE:
            return validate_args(args, *rest, **kwargs)
        if getattr(args, "rank", 0) == 0:
            print("[adapter] --fine-grained-activation-offloading: megatron's offload manager saves the inputs of "
                  f"{' '.join(args.offload_modules or [])} on this backend's streams, with the local spec", flush=True)
        return validated_with_flag_hidden(validate_args, args, "fine_grained_activation_offloading", *rest, **kwargs)

    return validate


def affinity_as_launched() -> None:
    """``set_ideal_affinity_for_current_gpu`` off CUDA: no NVIDIA GPU's NUMA node to bind to."""


def register(registry, versions: str) -> None:
    registry.replace(f"{_OFFLOAD}:ChunkOffloadHandler._can_manage_tensor_for_offload", activation_offload.can_manage,
                     versions=versions, backends=OFF_CUDA, optional=True,
                     reason="megatron offloads only tensors on 'cuda': off CUDA, those on this backend's device")
    registry.bind("megatron.core.extensions.transformer_engine:cpu_offload", activation_offload.TE_FLAG,
                  versions=versions, backends=OFF_CUDA,
                  reason="the offload context sets TE's flag for TE's layers; without TE none reads it")
    registry.wrap("megatron.training.arguments:validate_args", offloading_without_transformer_engine,
                  versions=versions, backends=OFF_CUDA,
                  reason="--fine-grained-activation-offloading asserts TE's spec; the manager runs the local one")
    registry.replace("megatron.core.pipeline_parallel.utils:set_ideal_affinity_for_current_gpu", affinity_as_launched,
                     versions=versions, backends=OFF_CUDA, optional=True,
                     reason="binds CPUs to an NVIDIA GPU's NUMA node through NVML; off CUDA there is none")

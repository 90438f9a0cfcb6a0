"""CUDA-only features, the registry entries: features that need CUDA itself (the mechanism:
``adapter/cuda_only_features.py``), refused off CUDA where they are configured, with one line naming the
setting: megatron's config dataclasses as they are built, Megatron-LM's validate_args before any rank does
work, and the constructors of the classes that are the feature."""

from __future__ import annotations

import functools

from adapter import cuda_only_features

OFF_CUDA = ("cpu", "npu")
_CONFIGS = ("megatron.core.transformer.transformer_config:TransformerConfig.__post_init__",
            "megatron.core.distributed.distributed_data_parallel_config:DistributedDataParallelConfig.__post_init__",
            # optimizer_cuda_graph (0.17+) is an OptimizerConfig field; on 0.16.1 the config has no CUDA-only one
            "megatron.core.optimizer.optimizer_config:OptimizerConfig.__post_init__")
_REFIT = "megatron.core.resharding.refit:get_or_create_service"


def refuse_configured(configure):
    """For a config's ``__post_init__`` and for Megatron-LM's ``validate_args``: what they configure (the
    config, or the args namespace) is checked before megatron's own checks run, so the refusal is the first
    thing said."""

    @functools.wraps(configure)
    def checked(source, *args, **kwargs):
        cuda_only_features.check(source)
        return configure(source, *args, **kwargs)

    return checked


def refuse_arguments(validate_args):
    """For Megatron-LM's ``validate_args``: as ``refuse_configured``, the setting named as its flag
    (``--fp8-format hybrid``), before megatron's own checks and anything that builds a model. Its
    ``CudaOnlyFeatureError`` becomes one line per job in ``adapter.run``."""

    @functools.wraps(validate_args)
    def checked(args, *rest, **kwargs):
        cuda_only_features.check(args, flags=True)
        return validate_args(args, *rest, **kwargs)

    return checked


def _refuse_constructing(feature: cuda_only_features.Feature, target: str):
    def wrap(init):
        @functools.wraps(init)
        def refused(self, *args, **kwargs):
            raise cuda_only_features.refusal(feature, f"{target.partition(':')[2].rpartition('.')[0]}(...)")

        return refused

    return wrap


def refuse_nvshmem_refit(get_or_create_service):
    """The refit backends that copy between CUDA devices (NVSHMEM; NIXL from 0.19) are refused by name where
    a service is made for them; gloo (and nccl, routed to this backend's library) pass."""
    refits = [f for f in cuda_only_features.FEATURES if f.settings == ("refit_method",)]

    @functools.wraps(get_or_create_service)
    def service(backend, *args, **kwargs):
        for feature in refits:
            if backend in feature.values:
                raise cuda_only_features.refusal(feature, f"refit backend {backend!r}")
        return get_or_create_service(backend, *args, **kwargs)

    return service


def register(registry, versions: str) -> None:
    for target in _CONFIGS:
        registry.wrap(target, refuse_configured, versions=versions, backends=OFF_CUDA,
                      reason="CUDA-only features (CUDA graphs, fp8, Megatron-FSDP, ...) refused where configured")
    registry.wrap("megatron.training.arguments:validate_args", refuse_arguments, versions=versions,
                  backends=OFF_CUDA, reason="CUDA-only features refused before any rank does work")
    registry.wrap(_REFIT, refuse_nvshmem_refit, versions=versions, backends=OFF_CUDA,
                  reason="the NVSHMEM and NIXL copy services copy between CUDA devices")
    for feature in cuda_only_features.FEATURES:
        for target in feature.constructors:
            registry.wrap(target, _refuse_constructing(feature, target), versions=versions, backends=OFF_CUDA,
                          reason=f"{feature.name} needs CUDA: {feature.why}")

"""Optimizer offloading to host memory, refused on the cpu backend, where there is no device to offload from.

megatron's ``HybridDeviceOptimizer`` moves ``offload_fraction`` of the parameters to host copies and tells
them apart from the rest by ``is_cuda``. On the cpu backend every tensor already lives in host memory and
is this backend's device, so a host copy cannot be told apart: it lands with the device parameters, its
updates are never copied back, and training silently diverges from the same optimizer run without
offloading. Refused where it is configured (``OptimizerConfig``) and where it is built, with the fix.
On npu and cuda offloading is real and nothing changes. Under the host stand-in (``adapter.host_memory``,
for tests) host copies are told apart as on an NPU, and megatron's offloading runs as written.
"""

from __future__ import annotations

import functools

from adapter import host_memory
from adapter.cuda_only_features import RefusedSetting

_OPTIMIZER = "megatron.core.optimizer"


class HostOffloadError(RefusedSetting):
    """Optimizer offloading to host memory was configured on the cpu backend (a refused setting: one line
    for the job under adapter.run)."""


def _refusal(setting: str) -> HostOffloadError:
    return HostOffloadError(
        f"{setting}: offloading optimizer state to host memory needs an accelerator to offload from; on the "
        "cpu backend every tensor already lives in host memory: drop --optimizer-cpu-offload (or use an "
        "offload fraction of 0) to run here")


def refuse_offloading_config(post_init):
    """``OptimizerConfig.__post_init__``: refuse ``optimizer_cpu_offload`` with a fraction above 0."""

    @functools.wraps(post_init)
    def checked(config, *args, **kwargs):
        if config.optimizer_cpu_offload and config.optimizer_offload_fraction > 0 and not host_memory.stand_in():
            raise _refusal(f"optimizer_cpu_offload=True with optimizer_offload_fraction="
                           f"{config.optimizer_offload_fraction!r}")
        return post_init(config, *args, **kwargs)

    return checked


def refuse_offloading_float32(post_init):
    """``OptimizerConfig.__post_init__`` on every backend: offloading with float32 parameters is refused in one
    line. megatron's distributed optimizer hands its HybridDeviceOptimizer float32 parameters as views of the
    model's (``model_param.view(-1)[range]``), and torch's optimizer refuses them ("can't optimize a non-leaf
    Tensor", a traceback on every rank, on every device); bf16 and fp16 parameters reach it as detached
    shards."""

    @functools.wraps(post_init)
    def checked(config, *args, **kwargs):
        if config.optimizer_cpu_offload and config.optimizer_offload_fraction > 0 and not (config.bf16 or config.fp16):
            raise HostOffloadError(
                f"optimizer_cpu_offload=True with float32 parameters (optimizer_offload_fraction="
                f"{config.optimizer_offload_fraction!r}): megatron's HybridDeviceOptimizer takes bf16 or fp16 "
                "parameters (float32 ones reach it as views, which torch's optimizers refuse): add --bf16 (or --fp16)")
        return post_init(config, *args, **kwargs)

    return checked


def refuse_offloading_optimizer(init):
    """``HybridDeviceOptimizer.__init__``: refuse an ``offload_fraction`` above 0 (0 runs as written)."""

    @functools.wraps(init)
    def checked(self, params, offload_fraction=0.5, *args, **kwargs):
        if offload_fraction > 0 and not host_memory.stand_in():
            raise _refusal(f"HybridDeviceOptimizer(offload_fraction={offload_fraction!r})")
        return init(self, params, offload_fraction, *args, **kwargs)

    return checked


def register(registry, versions: str) -> None:
    registry.wrap(f"{_OPTIMIZER}.optimizer_config:OptimizerConfig.__post_init__", refuse_offloading_float32,
                  versions=versions, reason="offloading float32 parameters: torch's optimizer refuses megatron's views")
    reason = "host copies cannot be told from device tensors on cpu: offloaded updates would be lost"
    registry.wrap(f"{_OPTIMIZER}.optimizer_config:OptimizerConfig.__post_init__", refuse_offloading_config,
                  versions=versions, backends=("cpu",), reason=reason)
    registry.wrap(f"{_OPTIMIZER}.cpu_offloading.hybrid_optimizer:HybridDeviceOptimizer.__init__",
                  refuse_offloading_optimizer, versions=versions, backends=("cpu",), reason=reason)

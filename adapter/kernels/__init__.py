"""Fused-kernel providers: which implementation of RMSNorm, SwiGLU, RoPE, softmax, cross entropy, core
attention and the MoE experts' grouped GEMM megatron's layers get.

The provider is chosen apart from the device (``adapter.backend``): it defaults from the backend (npu -> npu,
cuda -> cuda, cpu -> torch) and ``ADAPTER_KERNELS=npu|cuda|torch`` overrides it, so the npu provider's
argument building runs on CPU tensors against the torch_npu double in the tests.

- ``torch``: plain PyTorch, the reference; numerically megatron's local path.
- ``npu``: torch_npu's fused ops (npu_rms_norm, npu_swiglu, npu_rotary_mul, npu_fusion_attention,
  npu_scaled_masked_softmax, npu_cross_entropy_loss).
- ``cuda``: what is installed (Transformer Engine, apex, flash-attn), else PyTorch's fused
  scaled_dot_product_attention.

Each provider is a module with the same names (``PROVIDER_API``): it defines what it supplies, and the base
(``adapter.kernels.provider``) adds the defaults for the rest. ``patches/kernels.py`` and the layer specs bind
them directly, so a forward pass calls the chosen kernel with no dispatch in between.
"""

from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType

from adapter import backend as _backend
from adapter.kernels.provider import PROVIDER_API  # noqa: F401 - what every provider module defines

KERNELS_ENV = "ADAPTER_KERNELS"
PROVIDERS = ("npu", "cuda", "torch")
DEFAULT_FOR_BACKEND = {"npu": "npu", "cuda": "cuda", "cpu": "torch"}


class KernelProviderUnavailable(RuntimeError):
    """The requested kernel provider cannot run in this environment."""


class UnsupportedKernelSetting(ValueError):
    """A model setting a provider's kernel would otherwise compute wrongly: refused, naming the fix."""


def select_provider(requested: str | None = None) -> ModuleType:
    """Resolve ``requested`` (or ``$ADAPTER_KERNELS``; empty means: follow the backend) to a provider
    module. Importing the npu provider needs a module named ``torch_npu``, not an NPU. Provider modules do
    not import megatron, so choosing one at ``import adapter`` keeps megatron unimported."""
    if requested is None:
        requested = os.environ.get(KERNELS_ENV, "")
    name = requested.strip().lower() or DEFAULT_FOR_BACKEND[_backend.current().name]
    if name not in PROVIDERS:
        raise KernelProviderUnavailable(
            f"{KERNELS_ENV}={requested!r} is not a kernel provider: use one of {', '.join(PROVIDERS)} "
            "(or leave it unset to follow the backend)")
    try:
        return importlib.import_module(f"adapter.kernels.{name}_provider")
    except ImportError as exc:
        raise KernelProviderUnavailable(
            f"kernel provider {name!r} cannot be loaded: {exc}. "
            + ("It needs torch_npu (CANN's torch_npu wheel, or the tests' double on sys.path)."
               if name == "npu" else "")) from exc


@functools.lru_cache(maxsize=None)
def current() -> ModuleType:
    """This process's kernel provider, chosen once."""
    return select_provider()


@functools.lru_cache(maxsize=None)
def norm_module(provider: ModuleType | None = None) -> type:
    """The norm class megatron's specs get for ``provider``: Transformer Engine's on CUDA when installed,
    else the provider's ``Norm``."""
    provider = provider or current()
    return provider.installed_norm() or provider.Norm


@functools.lru_cache(maxsize=None)
def core_attention_module(provider: ModuleType | None = None) -> type:
    """The core-attention class megatron's specs get for ``provider`` (default: this process's): what the
    provider finds installed (Transformer Engine's on CUDA), else ``CoreAttention`` over its function."""
    from adapter.kernels.attention import CoreAttention

    provider = provider or current()
    installed = provider.installed_core_attention()
    if installed is not None:
        return installed
    return type(f"{provider.NAME.capitalize()}CoreAttention", (CoreAttention,),
                {"attention": staticmethod(provider.attention), "kernels": provider, "__module__": __name__})


@functools.lru_cache(maxsize=None)
def grouped_linear_modules(provider: ModuleType | None = None) -> tuple[type, type]:
    """The experts' (fc1, fc2) grouped linear classes ``moe_grouped_gemm`` gets for ``provider``: what the
    provider finds installed (Transformer Engine's on CUDA), else ``GroupedLinear`` over its
    ``grouped_mm``."""
    from adapter.kernels.grouped_linear import ColumnParallelGroupedLinear, RowParallelGroupedLinear

    provider = provider or current()
    installed = provider.installed_grouped_linear()
    if installed is not None:
        return installed
    name = provider.NAME.capitalize()
    return tuple(type(f"{name}{base.__name__}", (base,),
                      {"grouped_mm": staticmethod(provider.grouped_mm), "__module__": __name__})
                 for base in (ColumnParallelGroupedLinear, RowParallelGroupedLinear))

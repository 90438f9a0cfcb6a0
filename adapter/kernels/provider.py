"""The kernel-provider base: the names every provider has, and the defaults for those a provider does not
supply, so that a provider module states only what it supplies.

A provider stays a module of plain functions (``select_provider`` imports it): ``patches/kernels.py`` and the
layer specs bind those functions themselves, so a forward pass calls the kernel with nothing in between. A
class with the kernels as methods would need each of them listed a second time, so the base is a namespace
instead: a provider module defines its kernels and ends with ``complete(globals())``, which adds the
defaults below for the names it left out and refuses a provider that lacks a kernel of its own.
"""

from __future__ import annotations

# What only a provider can say: its name, and the kernels the adapter's own modules call (core attention,
# ring attention's blocks, the norm, the experts' grouped GEMM, the token permutation), which have no
# implementation of megatron's to fall back on.
REQUIRED = ("NAME", "attention", "attention_with_lse", "attention_grad_from_lse", "rms_norm", "layer_norm",
            "grouped_mm", "moe_permute")


def installed_norm():
    """No installed norm module (Transformer Engine's, on CUDA) replaces the provider's ``Norm``."""
    return None


def installed_core_attention():
    """No installed core attention replaces ``CoreAttention`` over the provider's ``attention``."""
    return None


def installed_grouped_linear():
    """No installed grouped linear layers replace ``GroupedLinear`` over the provider's ``grouped_mm``."""
    return None


# An entry of None leaves megatron's own implementation in place (patches/kernels.py binds nothing for it).
# Gated DeltaNet's kernels (chunk_gated_delta_rule, causal_conv1d, l2norm) take flash-linear-attention's
# interfaces; None leaves megatron's own, which is flash-linear-attention where installed, else a refusal.
DEFAULTS = {"installed_norm": installed_norm, "installed_core_attention": installed_core_attention,
            "installed_grouped_linear": installed_grouped_linear, "bias_swiglu": None, "rope": None,
            "rope_thd": None, "softmax_fusable": None, "scaled_masked_softmax": None,
            "vocab_parallel_cross_entropy": None, "chunk_gated_delta_rule": None, "causal_conv1d": None,
            "l2norm": None}

# Every name a provider module has once completed: ``Norm`` (the norm class over its rms_norm/layer_norm)
# and ``merge_with_lse`` (ring attention's merge of two blocks) default to what ``complete`` builds.
PROVIDER_API = (*REQUIRED, "Norm", "merge_with_lse", *DEFAULTS)


def complete(namespace: dict) -> None:
    """Adds to a provider module's ``namespace`` (its ``globals()``) the defaults of the names it does not
    define; a provider without one of ``REQUIRED`` fails at import, not at the first step that needs it."""
    # Imported here: adapter.kernels imports this module for PROVIDER_API before it defines the exceptions
    # these two import from it.
    from adapter.kernels.context_parallel import merge_with_lse

    missing = [name for name in REQUIRED if name not in namespace]
    if missing:
        raise NotImplementedError(f"kernel provider {namespace['__name__']} defines no {', '.join(missing)}: "
                                  f"every provider supplies {', '.join(REQUIRED)}")
    for name, default in DEFAULTS.items():
        namespace.setdefault(name, default)
    namespace.setdefault("merge_with_lse", merge_with_lse)
    if "Norm" not in namespace:
        norm = _norm_class(namespace)
        # under its class name too, where pickle looks a class up (TorchNorm, NpuNorm, CudaNorm)
        namespace["Norm"] = namespace[norm.__name__] = norm


def _norm_class(namespace: dict) -> type:
    """The provider's norm module: ``FusedNorm`` over its ``rms_norm`` and ``layer_norm``, named after it and
    defined in its module (what ``python -m adapter`` and the model's repr show)."""
    from adapter.kernels.norm import FusedNorm  # here for complete's reason

    return type(f"{namespace['NAME'].capitalize()}Norm", (FusedNorm,), {
        "rms_norm": staticmethod(namespace["rms_norm"]), "layer_norm": staticmethod(namespace["layer_norm"]),
        "__module__": namespace["__name__"]})

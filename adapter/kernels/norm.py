"""The norm module every provider hands to megatron's layer specs (input, pre-MLP, final and QK norms).

Megatron's local norm (``WrappedTorchNorm``) refuses sequence parallelism, so TP + SP needs a norm of our
own: under SP each tensor-parallel rank normalises its own slice of the sequence, and megatron all-reduces
the gradient of every parameter marked ``sequence_parallel`` across the TP group
(``finalize_model_grads``). Marking the parameters is all a norm has to do for that.
"""

from __future__ import annotations

import torch

from adapter.kernels import UnsupportedKernelSetting


class FusedNorm(torch.nn.Module):
    """LayerNorm or RMSNorm (from ``config.normalization``) over the last dimension, through the provider's
    ``rms_norm(x, weight, eps)`` / ``layer_norm(x, weight, bias, eps)``, which a provider subclass binds.

    ``layernorm_zero_centered_gamma`` stores ``gamma - 1`` (initialised to zeros), as megatron's fused
    norms do, so weight decay pulls gamma towards 1. ``persist_layer_norm`` and
    ``memory_efficient_layer_norm`` choose between apex kernels and mean nothing here."""

    rms_norm = None
    layer_norm = None

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization: str | None = None):
        super().__init__()
        self.normalization = normalization or config.normalization
        if self.normalization not in ("RMSNorm", "LayerNorm"):
            raise UnsupportedKernelSetting(
                f"normalization={self.normalization!r}: the adapter's norm implements 'RMSNorm' and "
                "'LayerNorm'; set TransformerConfig.normalization to one of them")
        self.eps = eps
        self.zero_centered_gamma = zero_centered_gamma or config.layernorm_zero_centered_gamma
        init = torch.zeros if self.zero_centered_gamma else torch.ones
        # Created where torch creates by default, like megatron's local norm; the model is moved later.
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=config.params_dtype))
        self.bias = None
        if self.normalization == "LayerNorm":
            self.bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight + 1 if self.zero_centered_gamma else self.weight
        if self.bias is None:
            return self.rms_norm(x, weight, self.eps)
        return self.layer_norm(x, weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalization}, {tuple(self.weight.shape)}, eps={self.eps}"

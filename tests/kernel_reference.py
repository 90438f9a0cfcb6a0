"""Megatron's own local implementations, set up as the reference every kernel provider is held to, and
the shared setup for kernel tests (configs, a one-rank model-parallel world, tolerances)."""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

import adapter

# fp32: the bound. bf16 (8 mantissa bits): two roundings apart at most, relative to the values.
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


@contextlib.contextmanager
def one_rank_model_parallel(seed: int = 1234):
    """A world of one with megatron's model-parallel state and RNG tracker, torn down afterwards."""
    adapter.init_distributed()
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(seed)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


def attention_config(heads: int = 8, groups: int = 8, head_dim: int = 16, dtype=torch.float32,
                     **overrides) -> TransformerConfig:
    settings = dict(num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
                    num_query_groups=groups, kv_channels=head_dim, attention_dropout=0.0,
                    use_cpu_initialization=True, params_dtype=dtype, bf16=dtype == torch.bfloat16,
                    attention_softmax_in_fp32=True)
    settings.update(overrides)
    return TransformerConfig(**settings)


def megatron_attention(config, mask_type: AttnMaskType, **kwargs) -> DotProductAttention:
    return DotProductAttention(config, layer_number=1, attn_mask_type=mask_type, attention_type="self",
                               **kwargs)


def megatron_swiglu(x, bias):
    """MLP's unfused gated activation (bias_activation_fusion=False)."""
    if bias is not None:
        x = x + bias
    gate, linear = torch.chunk(x, 2, dim=-1)
    return F.silu(gate) * linear


def leaves(*tensors):
    return [t.detach().clone().requires_grad_(True) for t in tensors]


def forward_backward(fn, inputs, grad_seed: int = 7, rows=None):
    """Output of ``fn(*inputs)`` and the gradients of a fixed random projection of it (optionally of the
    ``rows`` selected along dim 0 only) with respect to every input."""
    out = fn(*inputs)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed)).to(out)  # dtype, device
    projected = out * weight
    if rows is not None:
        projected = projected[rows]
    projected.float().sum().backward()
    return [out.detach()] + [t.grad for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]


def assert_all_close(actual, expected, dtype) -> None:
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a.float(), e.float(), **TOLERANCE[dtype])


def called(provider, op: str) -> None:
    """For the npu provider: assert torch_npu's ``op`` really ran (the double counts its calls)."""
    if provider.NAME == "npu":
        assert sys.modules["torch_npu"].CALLS[op] > 0, f"the npu provider did not call torch_npu.{op}"


def randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)

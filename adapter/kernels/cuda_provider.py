"""The ``cuda`` kernel provider: what is installed, else PyTorch's fused kernels.

- Transformer Engine installed: megatron's own ``TEDotProductAttention`` and ``TENorm``, and megatron's
  TE-backed RoPE and cross entropy stay as megatron wires them.
- flash-attn installed: ``flash_attn_func`` / ``flash_attn_varlen_func`` for CUDA half-precision tensors
  without an explicit mask (GQA, causal, sliding window and packed sequences natively).
- Otherwise ``scaled_dot_product_attention``, which picks its flash or memory-efficient kernel on CUDA
  and takes GQA unexpanded (``enable_gqa``).

It also runs on CPU tensors (SDPA's CPU kernels), which is how its argument building is tested here.
"""

from __future__ import annotations

import importlib
import importlib.util

import torch

from adapter.kernels import UnsupportedKernelSetting, torch_provider
from adapter.kernels.norm import FusedNorm

NAME = "cuda"

HAVE_TE = importlib.util.find_spec("transformer_engine") is not None
HAVE_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None
HAVE_SOFTMAX_EXTENSION = importlib.util.find_spec("scaled_masked_softmax_cuda") is not None
HAVE_GROUPED_GEMM = importlib.util.find_spec("grouped_gemm") is not None


def _te_module(name: str):
    return getattr(importlib.import_module("megatron.core.extensions.transformer_engine"), name)


def installed_core_attention():
    return _te_module("TEDotProductAttention") if HAVE_TE else None


def installed_norm():
    return _te_module("TENorm") if HAVE_TE else None


def installed_grouped_linear():
    """Transformer Engine's grouped linear layers, as megatron's TE spec pairs them with TEGroupedMLP."""
    if not HAVE_TE:
        return None
    return _te_module("TEColumnParallelGroupedLinear"), _te_module("TERowParallelGroupedLinear")


def grouped_mm(x, weights, m_splits):
    """Without Transformer Engine: the ``grouped_gemm`` package's CUTLASS kernel when installed (what
    megatron's legacy GroupedMLP calls), else torch's grouped GEMM for CUDA bfloat16 (rows of whole
    16-byte multiples), else one GEMM per expert."""
    if x.is_cuda and HAVE_GROUPED_GEMM:
        gmm = importlib.import_module("grouped_gemm").ops.gmm
        return gmm(x, torch.stack(weights), torch.tensor(m_splits), trans_b=True)
    if x.is_cuda and x.dtype == torch.bfloat16 and not (x.shape[-1] % 8 or weights[0].shape[0] % 8):
        ends = torch.tensor(m_splits, dtype=torch.int32, device=x.device).cumsum(0, dtype=torch.int32)
        return torch.nn.functional.grouped_mm(x.contiguous(), torch.stack(weights).transpose(1, 2), offs=ends)
    return torch_provider.grouped_mm(x, weights, m_splits)


# moe_permute_fusion without Transformer Engine (with it, megatron binds TE's fused permutation itself)
moe_permute = torch_provider.moe_permute


def _flash_attn():
    return importlib.import_module("flash_attn")


def _flash_window(window, causal) -> tuple[int, int]:
    if window is None:
        return (-1, -1)
    left, right = window
    return (left, 0 if causal else right)


def _use_flash_attn(q, mask) -> bool:
    return HAVE_FLASH_ATTN and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and mask is None


def attention(q, k, v, *, scale, causal, mask, window, dropout_p, cu_seqlens_q=None, cu_seqlens_kv=None):
    if q.shape[-2] % k.shape[-2]:
        raise UnsupportedKernelSetting(
            f"{q.shape[-2]} query heads over {k.shape[-2]} key/value heads: the query heads must be a "
            "multiple of the key/value groups")
    if _use_flash_attn(q, mask):
        flash = _flash_attn()
        if cu_seqlens_q is not None:
            out = flash.flash_attn_varlen_func(
                q, k, v, cu_seqlens_q, cu_seqlens_kv,
                int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()),
                int((cu_seqlens_kv[1:] - cu_seqlens_kv[:-1]).max()),
                dropout_p=dropout_p, softmax_scale=scale, causal=causal,
                window_size=_flash_window(window, causal))
            return out.reshape(out.shape[0], -1)
        sq, b = q.shape[:2]
        out = flash.flash_attn_func(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                    dropout_p=dropout_p, softmax_scale=scale, causal=causal,
                                    window_size=_flash_window(window, causal))
        return out.transpose(0, 1).reshape(sq, b, -1)
    if cu_seqlens_q is None:
        return torch_provider.sdpa_attention(q, k, v, scale, causal, mask, window, dropout_p)
    return torch_provider.per_sequence(torch_provider.sdpa_attention, q, k, v, cu_seqlens_q, cu_seqlens_kv,
                                       scale, causal, window, dropout_p)


def _sdpa_flash_with_lse(q) -> bool:
    """PyTorch's own flash-attention kernel (SDPA's), which hands back the rows' log-sum-exp, takes fp16 /
    bf16 CUDA tensors with a head size that is a multiple of 8, at most 256."""
    d = q.shape[-1]
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and d % 8 == 0 and d <= 256


def attention_with_lse(q, k, v, *, scale, causal):
    """Ring attention's block (the contract of ``torch_provider.attention_with_lse``) on SDPA's flash kernel
    where it runs, else the torch provider's. With Transformer Engine installed megatron's own TE attention
    does context parallelism and this is not used."""
    if not _sdpa_flash_with_lse(q):
        return torch_provider.attention_with_lse(q, k, v, scale=scale, causal=causal)
    k, v = torch_provider.grouped_kv(k, v, q.shape[1])
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
        q.contiguous(), k.contiguous(), v.contiguous(), 0.0, causal, scale=scale)[:2]
    return out, lse


def attention_grad_from_lse(dout, q, k, v, out, lse, *, scale, causal):
    """The block's gradients from the rows' global out and lse (``torch_provider.attention_grad_from_lse``)
    on the flash kernel's backward, which rebuilds the softmax as exp(scores - lse); no packing and no
    dropout, so its cumulative lengths and RNG state are empty."""
    if not _sdpa_flash_with_lse(q):
        return torch_provider.attention_grad_from_lse(dout, q, k, v, out, lse, scale=scale, causal=causal)
    groups = k.shape[1]
    k, v = torch_provider.grouped_kv(k, v, q.shape[1])
    unused = torch.empty(0, dtype=torch.int64, device=q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout.to(q.dtype).contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out.to(q.dtype).contiguous(),
        lse.float().contiguous(), unused, unused, q.shape[2], k.shape[2], 0.0, causal, unused, unused, scale=scale)
    return dq, torch_provider.summed_over_groups(dk, groups), torch_provider.summed_over_groups(dv, groups)


def _no_softmax_extension(self, mask, b, np, sq, sk) -> bool:
    """Without apex's scaled_masked_softmax_cuda extension megatron's availability check would import it
    and fail; use the torch softmax instead."""
    return False


# With the extension, megatron's own availability check and fused softmax stay.
softmax_fusable = None if HAVE_SOFTMAX_EXTENSION else _no_softmax_extension
rms_norm = torch_provider.rms_norm
layer_norm = torch_provider.layer_norm
# megatron's own SwiGLU, scaled masked softmax (apex's kernel) and cross entropy (native or TE) stay in
# place, and so does RoPE where Transformer Engine supplies it. Without TE, megatron has no fused RoPE and
# refuses apply_rope_fusion (its default in Megatron-LM's arguments); the torch provider's then answers it.
bias_swiglu = None
rope = None if HAVE_TE else torch_provider.rope
rope_thd = None if HAVE_TE else torch_provider.rope_thd
scaled_masked_softmax = None
vocab_parallel_cross_entropy = None


class CudaNorm(FusedNorm):
    rms_norm = staticmethod(rms_norm)
    layer_norm = staticmethod(layer_norm)


Norm = CudaNorm

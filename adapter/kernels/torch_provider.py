"""The ``torch`` kernel provider: plain PyTorch, the reference the other providers are held to.

Numerically it is megatron's local path (same operation order, softmax in float32, masked scores filled
with megatron's -10000), but it also takes what that path refuses: sequence parallelism in the norm,
packed sequences, ``apply_rope_fusion`` and ``cross_entropy_loss_fusion`` on any device.

One exception, for speed: causal or full attention with no explicit mask, window or dropout (what
pretraining runs) goes to ``scaled_dot_product_attention``, which computes the same softmax(QK^T)V in
float32 without materialising the [b, n, s, s] scores or repeating K/V for GQA; it agrees with the
unfused algorithm to float rounding. Masks, windows and dropout keep the unfused path, so megatron's
masking and its RNG-tracked dropout are reproduced exactly.
"""

from __future__ import annotations

import itertools
import os

import torch
import torch.nn.functional as F

from adapter import backend as _backend
from adapter.kernels import UnsupportedKernelSetting, cross_entropy, gated_delta
from adapter.kernels import moe_permute as _moe_permute
from adapter.kernels.provider import complete

NAME = "torch"

MASKED_SCORE = -10000.0  # megatron's attention_mask_func fill value


def _eager_rms_norm(x, weight, eps):
    return F.rms_norm(x, weight.shape, weight, eps)


# On the CPU, eager rms_norm makes a pass over x per elementwise op, forward and backward; compiled
# (as megatron compiles its own fused ops, jit_fuser) it takes 0.37x the time at [2048, 1024]. Other
# devices keep eager: the inductor may not know them (Ascend), and their providers bring fused norms.
rms_norm = torch.compile(_eager_rms_norm) if _backend.current().name == "cpu" else _eager_rms_norm


def layer_norm(x, weight, bias, eps):
    return F.layer_norm(x, weight.shape, weight, bias, eps)


def masked_positions(sq: int, sk: int, causal: bool, window, device) -> torch.Tensor | None:
    """[sq, sk] bool, True where a causal and/or sliding-window (bottom-right aligned) mask hides a key."""
    if not causal and window is None:
        return None
    i = torch.arange(sq, device=device).unsqueeze(1) + (sk - sq)
    j = torch.arange(sk, device=device).unsqueeze(0)
    hidden = torch.zeros(sq, sk, dtype=torch.bool, device=device)
    right = 0 if causal else None
    if window is not None:
        left, window_right = window
        if left >= 0:
            hidden |= j < i - left
        if window_right >= 0:
            right = window_right if right is None else min(right, window_right)
    if right is not None:
        hidden |= j > i + right
    return hidden


def _dense_attention(q, k, v, scale, causal, mask, window, dropout_p):
    sq, b, nq, _ = q.shape
    sk, nkv = k.shape[0], k.shape[2]
    if nq != nkv:
        k = k.repeat_interleave(nq // nkv, dim=2)
        v = v.repeat_interleave(nq // nkv, dim=2)
    scores = torch.matmul(q.permute(1, 2, 0, 3), k.permute(1, 2, 3, 0)) * scale  # [b, nq, sq, sk]
    scores = scores.float()
    hidden = masked_positions(sq, sk, causal, window, q.device)
    if mask is not None:
        hidden = mask if hidden is None else (mask | hidden)
    if hidden is not None:
        scores = scores.masked_fill(hidden, MASKED_SCORE)
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    if dropout_p > 0.0:
        probs = F.dropout(probs, dropout_p)
    context = torch.matmul(probs, v.permute(1, 2, 0, 3))  # [b, nq, sq, dv]
    return context.permute(2, 0, 1, 3).reshape(sq, b, -1)


SDPA_CONTIGUOUS_ENV = "ADAPTER_SDPA_CONTIGUOUS"


def _contiguous(t):
    return t.contiguous()


def _as_is(t):
    return t


def sdpa_layout(backend_name: str, setting: str | None):
    """How SDPA gets q/k/v [b, n, s, d]: copied to that layout in memory on the CPU, whose kernels run ~10%
    faster so; as megatron's permuted [s, b, n, d] views elsewhere, which CUDA's flash kernel reads as
    they are (a copy of each would cost a pass over q, k and v per layer, forward and backward).
    ``ADAPTER_SDPA_CONTIGUOUS=1|0`` overrides, to measure either way."""
    contiguous = backend_name == "cpu" if setting in (None, "") else setting == "1"
    return _contiguous if contiguous else _as_is


_sdpa_layout = sdpa_layout(_backend.current().name, os.environ.get(SDPA_CONTIGUOUS_ENV))


def sdpa_attention(q, k, v, scale, causal, mask, window, dropout_p):
    """Dense attention through ``scaled_dot_product_attention``, q [sq, b, nq, d], v [sk, b, nkv, dv] ->
    [sq, b, nq * dv] (SDPA takes a value head size apart from the query/key one, as MLA needs)."""
    sq, b, nq, _ = q.shape
    sk, nkv = k.shape[0], k.shape[2]
    hidden = None
    if mask is not None or window is not None or (causal and sq != sk):
        # SDPA's is_causal is top-left aligned; anything else goes in as an explicit mask
        hidden = masked_positions(sq, sk, causal, window, q.device)
        if mask is not None:
            hidden = mask if hidden is None else (mask | hidden)
    q, k, v = (_sdpa_layout(t.permute(1, 2, 0, 3)) for t in (q, k, v))
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=None if hidden is None else ~hidden, dropout_p=dropout_p,
        is_causal=causal and hidden is None, scale=scale, enable_gqa=nq != nkv)
    return out.permute(2, 0, 1, 3).reshape(sq, b, -1)


def _dense(q, k, v, scale, causal, mask, window, dropout_p):
    if mask is None and window is None and dropout_p == 0.0 and (not causal or q.shape[0] == k.shape[0]):
        return sdpa_attention(q, k, v, scale, causal, mask, window, dropout_p)
    return _dense_attention(q, k, v, scale, causal, mask, window, dropout_p)


def attention(q, k, v, *, scale, causal, mask, window, dropout_p, cu_seqlens_q=None, cu_seqlens_kv=None):
    if q.shape[-2] % k.shape[-2]:
        raise UnsupportedKernelSetting(f"{q.shape[-2]} query heads over {k.shape[-2]} key/value heads: the "
                                   "query heads must be a multiple of the key/value groups")
    if cu_seqlens_q is None:
        return _dense(q, k, v, scale, causal, mask, window, dropout_p)
    return per_sequence(_dense, q, k, v, cu_seqlens_q, cu_seqlens_kv, scale, causal, window, dropout_p)


def grouped_kv(k, v, heads: int):
    """K/V repeated to ``heads`` heads: query head i reads key/value group i // (heads / groups)."""
    groups = k.shape[1]
    if groups == heads:
        return k, v
    return k.repeat_interleave(heads // groups, dim=1), v.repeat_interleave(heads // groups, dim=1)


def summed_over_groups(grad, groups: int):
    b, heads, s, d = grad.shape
    return grad if heads == groups else grad.view(b, groups, heads // groups, s, d).sum(2)


def _flash_cpu(q) -> bool:
    """torch's CPU flash kernel (which returns the log-sum-exp) takes CPU float tensors; elsewhere the math
    below runs."""
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _scores(q, k, scale, causal):
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1),
                                    -torch.inf)
    return scores


def attention_with_lse(q, k, v, *, scale, causal):
    """One block of context-parallel attention and its rows' log-sum-exp: q [b, nq, sq, d], k/v
    [b, nkv, sk, d] -> out [b, nq, sq, d] (q's dtype), lse [b, nq, sq] float32, and what the block's
    backward needs from its forward beyond those (``saved``: None here; a kernel's own state elsewhere);
    ``causal`` top-left aligned (sq == sk). The ring merges blocks by their lse
    (adapter/kernels/context_parallel.py)."""
    k, v = grouped_kv(k, v, q.shape[1])
    if _flash_cpu(q):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.contiguous(), k.contiguous(), v.contiguous(), 0.0, causal, scale=scale)
        return out, lse, None
    scores = _scores(q, k, scale, causal)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.float()).to(q.dtype), lse, None


def attention_grad_from_lse(dout, q, k, v, out, lse, *, scale, causal, saved=None):
    """(dq, dk, dv) of one block given its rows' GLOBAL out and lse (flash attention's backward, whose
    softmax is exp(scores - lse)): summed over the blocks, the gradients of attention over all keys. dk/dv
    in k/v's head count. ``saved``: the block forward's, unused here."""
    groups = k.shape[1]
    k, v = grouped_kv(k, v, q.shape[1])
    if _flash_cpu(q):
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.contiguous().to(q.dtype), q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(),
            lse.contiguous(), 0.0, causal, scale=scale)
    else:
        dout, probs = dout.float(), torch.exp(_scores(q, k, scale, causal) - lse.unsqueeze(-1))
        dv = torch.matmul(probs.transpose(-1, -2), dout)
        dscores = probs * (torch.matmul(dout, v.float().transpose(-1, -2))
                           - (dout * out.float()).sum(-1, keepdim=True))
        dq, dk = torch.matmul(dscores, k.float()) * scale, torch.matmul(dscores.transpose(-1, -2), q.float()) * scale
    return dq, summed_over_groups(dk, groups), summed_over_groups(dv, groups)


def per_sequence(dense, q, k, v, cu_seqlens_q, cu_seqlens_kv, scale, causal, window, dropout_p):
    """Packed attention as one ``dense`` call per sequence (a batch of one, no cross-sequence keys)."""
    bounds_q, bounds_kv = cu_seqlens_q.tolist(), cu_seqlens_kv.tolist()
    outputs = [
        dense(q[q0:q1].unsqueeze(1), k[k0:k1].unsqueeze(1), v[k0:k1].unsqueeze(1),
              scale, causal, None, window, dropout_p).squeeze(1)
        for q0, q1, k0, k1 in zip(bounds_q[:-1], bounds_q[1:], bounds_kv[:-1], bounds_kv[1:])]
    return torch.cat(outputs)


def _swap(x, interleaved: bool):
    """Each element's RoPE partner, unsigned: (x2, x1) over halves, or each (even, odd) pair swapped.
    The rotation's sign, (-x2, x1), rides on the sine (``_cos_sin``), computed once, not per tensor."""
    if interleaved:
        return x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x2, x1), dim=-1)


_last_angles: list = [None]  # (freqs, its version, dtype, interleaved, cos, signed sin)


def _cos_sin(freqs, dtype, interleaved: bool):
    """cos(freqs) and sin(freqs) with the rotation's sign (negative on the first half, or on the even
    elements when interleaved), computed once per angle tensor: megatron's rotary embedding caches its
    output, so every layer (q and k) and every step gets the same tensor."""
    cached = _last_angles[0]
    if (cached is not None and cached[0] is freqs and cached[1] == freqs._version and cached[2] == dtype
            and cached[3] == interleaved):
        return cached[4], cached[5]
    sin = torch.sin(freqs)
    sign = torch.ones(freqs.shape[-1], dtype=freqs.dtype, device=freqs.device)
    if interleaved:
        sign[0::2] = -1
    else:
        sign[: freqs.shape[-1] // 2] = -1
    cos, sin = torch.cos(freqs).to(dtype), (sin * sign).to(dtype)
    if not freqs.requires_grad:
        _last_angles[0] = (freqs, freqs._version, dtype, interleaved, cos, sin)
    return cos, sin


def rotated(t, cos, sin, interleaved: bool):
    """t [s, b, h, d] rotated by the angles' cos and signed sin [s, 1, 1, d_rot] (``_cos_sin``); dims past
    d_rot pass through. The elementwise part of RoPE, apart so that a provider can compile it alone."""
    rot = cos.shape[-1]
    if rot == t.shape[-1]:
        return t * cos + _swap(t, interleaved) * sin
    x = t[..., :rot]
    return torch.cat((x * cos + _swap(x, interleaved) * sin, t[..., rot:]), dim=-1)


def rope_over(rotate, name: str):
    """megatron's fused-RoPE signature over ``rotate`` (``rotated`` or a compiled one), named ``name`` (what
    ``python -m adapter`` shows): the angles' cos and sin come from ``_cos_sin``'s cache, outside any
    compiled region."""

    def rope(t, freqs, transpose_output_memory: bool = False, interleaved: bool = False):
        """RoPE on t [s, b, h, d] with angles freqs [s, 1, 1, d_rot]; dims past d_rot pass through."""
        cos, sin = _cos_sin(freqs, t.dtype, interleaved)
        return rotate(t, cos, sin, interleaved)

    rope.__name__ = rope.__qualname__ = name
    return rope


rope = rope_over(rotated, "rope")


def packed_positions(cu_seqlens, total: int):
    """Position of every token of a packed batch inside its own sequence."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    starts = torch.repeat_interleave(cu_seqlens[:-1], lengths, output_size=total)
    return torch.arange(total, device=cu_seqlens.device) - starts


def check_rope_thd(cp_size: int) -> None:
    if cp_size != 1:
        raise UnsupportedKernelSetting(f"fused packed-sequence RoPE with cp_size={cp_size}: the adapter has "
                                   "no context parallelism; use context_parallel_size=1")


def rope_thd(t, cu_seqlens, freqs, cp_size: int = 1, cp_rank: int = 0):
    """RoPE on packed t [t, h, d]; each sequence's positions start at 0."""
    check_rope_thd(cp_size)
    angles = freqs[packed_positions(cu_seqlens, t.shape[0])]
    return rope(t.unsqueeze(1), angles).squeeze(1)


def softmax_fusable(self, mask, b, np, sq, sk) -> bool:
    """No fused softmax kernel here: megatron's own torch softmax runs (and never asks for the CUDA
    extension it would otherwise import)."""
    return False


# SwiGLU and the scaled masked softmax stay megatron's own (its torch.jit SwiGLU, its torch softmax)
vocab_parallel_cross_entropy = cross_entropy.vocab_parallel_cross_entropy


class _LoopedGroupedMM(torch.autograd.Function):
    """One GEMM per expert, each writing its rows of one output (and of dx and its dw slice in backward) in
    place. Composed from autograd ops instead, the loop pays a full copy of the rows to concatenate the
    experts' outputs in forward and another to concatenate the split's gradients in backward
    (bench/moe.py: ``grouped/cat``)."""

    @staticmethod
    def forward(ctx, x, weight, bounds):
        ctx.save_for_backward(x, weight)
        ctx.bounds = bounds
        out = x.new_empty(x.shape[0], weight.shape[1])
        for expert, (start, end) in enumerate(bounds):
            torch.mm(x[start:end], weight[expert].t(), out=out[start:end])
        return out

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dy = dy.contiguous()
        dx = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        dw = torch.empty_like(weight) if ctx.needs_input_grad[1] else None
        for expert, (start, end) in enumerate(ctx.bounds):
            if dx is not None:
                torch.mm(dy[start:end], weight[expert], out=dx[start:end])
            if dw is not None:  # an expert without rows gets zeros: a product over an empty inner dim
                torch.mm(dy[start:end].t(), x[start:end], out=dw[expert])
        return dx, dw, None


def _row_bounds(tokens_per_expert) -> list[tuple[int, int]]:
    """Each expert's [start, end) rows; a tensor of counts is read back to the host once, as slicing needs."""
    counts = tokens_per_expert.tolist() if torch.is_tensor(tokens_per_expert) else tokens_per_expert
    ends = list(itertools.accumulate(int(m) for m in counts))
    return list(zip([0, *ends[:-1]], ends))


def check_expert_counts(tokens_per_expert, weight) -> None:
    """One count per local expert, or every provider's grouped GEMM fails on its own terms (or, looping,
    silently leaves experts out); the length of a 1-D tensor is known on the host, no sync."""
    if len(tokens_per_expert) != weight.shape[0]:
        raise ValueError(f"tokens_per_expert has {len(tokens_per_expert)} experts but the weight "
                         f"{tuple(weight.shape)} has {weight.shape[0]}: pass one count per local expert")


def looped_grouped_mm(x, weight, tokens_per_expert):
    """``x[rows of i] @ weight[i].T`` expert by expert over the stacked weight [E, out, in]: one GEMM each,
    no copy of the weights or the rows. ``tokens_per_expert``: a list of ints or an int tensor."""
    check_expert_counts(tokens_per_expert, weight)
    return _LoopedGroupedMM.apply(x.contiguous(), weight, _row_bounds(tokens_per_expert))


# Measured against one torch grouped GEMM over the stacked weight (bench/moe.py): slower on the CPU at MoE
# shapes, and torch 2.13's CPU kernel drops bf16/fp16 gradients.
grouped_mm = looped_grouped_mm
# moe_permute_fusion: TE's interface over torch index ops (tokens in megatron's unfused order)
moe_permute = _moe_permute
# Gated DeltaNet (Qwen3.5, Qwen3-Next) without flash-linear-attention: the rule by chunks, the convolution
chunk_gated_delta_rule = gated_delta.chunk_gated_delta_rule
causal_conv1d = gated_delta.causal_conv1d
l2norm = gated_delta.l2norm

complete(globals())  # the base's defaults for the rest, and the norm class TorchNorm

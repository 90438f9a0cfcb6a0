"""Multi-latent attention's fused YaRN RoPE (``apply_rope_fusion`` with ``multi_latent_attention``) in plain
PyTorch, for devices Triton cannot compile for (Ascend, the CPU).

megatron-core's ``fused_apply_mla_rope_for_q`` / ``_for_kv`` are Triton kernels; these take the same
arguments and compute what the kernels compute (read from megatron/core/fusions/fused_mla_yarn_rope_apply.py):
the rotary part x of each head is read interleaved, x1 = x[..., 0::2], x2 = x[..., 1::2], and written
half-split, [x1 cos_l - x2 sin_l, x2 cos_r + x1 sin_r] with cos = [cos_l, cos_r] of the token's position
(YaRN's mscale is folded into the cached cos/sin). The key's rotary part is shared by the heads. A token's
position is its index along the sequence (sbhd: megatron's cos/sin are already this CP rank's), or within its
packed sequence (thd), where with context parallelism the rank holds chunks r and 2cp-1-r of each sequence.
Autograd gives the backward. Unlike the Triton kernel for q, which rotates its input in place and returns it,
this returns a new tensor: megatron's MLA uses only the return.
"""

from __future__ import annotations

import torch

_INTERLEAVED = ("fused MLA RoPE with rotary_interleaved=True: megatron's kernel has none either (and megatron "
                "refuses rotary_interleaved with multi_latent_attention)")


def _positions(t: torch.Tensor, cu_seqlens, cp_rank: int, cp_size: int) -> torch.Tensor:
    """Each row's position into cos/sin: [s] for sbhd, [total] for thd (the kernel's _get_thd_token_idx)."""
    if cu_seqlens is None:
        return torch.arange(t.shape[0], device=t.device)
    bounds = (cu_seqlens // cp_size).tolist()
    pieces = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        length = end - start
        local = torch.arange(length, device=t.device)
        if cp_size > 1:
            local = torch.where(local < length // 2, local + cp_rank * length // 2,
                                local - length // 2 + (2 * cp_size - cp_rank - 1) * length // 2)
        pieces.append(local)
    return torch.cat(pieces)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, sbhd: bool):
    """x [..., emb] read interleaved, rotated, written half-split; cos/sin [max_seq, 1, 1, emb]."""
    emb = x.shape[-1]
    cos, sin = (c.reshape(c.shape[0], emb)[positions] for c in (cos, sin))  # [rows, emb]
    shape = (-1, 1, 1, emb) if sbhd else (-1, 1, emb)
    cos, sin = cos.view(shape), sin.view(shape)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    half = emb // 2
    return torch.cat([x1 * cos[..., :half] - x2 * sin[..., :half], x2 * cos[..., half:] + x1 * sin[..., half:]],
                     dim=-1).to(x.dtype)


def fused_apply_mla_rope_for_q(t, cos, sin, qk_head_dim: int, emb_dim: int, cu_seqlens_q=None, cp_rank: int = 0,
                               cp_size: int = 1, rotary_interleaved: bool = False):
    """t [s, b, n, qk_head_dim + emb_dim] or [total, n, ...] -> the same with the last emb_dim rotated."""
    if rotary_interleaved:
        raise NotImplementedError(_INTERLEAVED)
    positions = _positions(t, cu_seqlens_q, cp_rank, cp_size)
    rotated = _rotate(t[..., qk_head_dim:qk_head_dim + emb_dim], cos, sin, positions, cu_seqlens_q is None)
    return torch.cat([t[..., :qk_head_dim], rotated], dim=-1)


def fused_apply_mla_rope_for_kv(kv, k_pos_emb, cos, sin, emb_dim: int, k_dim: int, v_dim: int, cu_seqlens_kv=None,
                                cp_rank: int = 0, cp_size: int = 1, rotary_interleaved: bool = False):
    """kv [s, b, n, k_dim + v_dim] (or thd), k_pos_emb [s, b, 1, emb_dim] -> key [..., n, k_dim + emb_dim]
    (the rotated k_pos_emb appended to every head) and value [..., n, v_dim]."""
    if rotary_interleaved:
        raise NotImplementedError(_INTERLEAVED)
    positions = _positions(kv, cu_seqlens_kv, cp_rank, cp_size)
    rotated = _rotate(k_pos_emb, cos, sin, positions, cu_seqlens_kv is None)
    key = torch.cat([kv[..., :k_dim], rotated.expand(*kv.shape[:-1], emb_dim)], dim=-1)
    return key, kv[..., k_dim:k_dim + v_dim].contiguous()

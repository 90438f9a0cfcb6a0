"""Core attention (megatron's ``core_attention`` submodule) over a provider's flash-attention function.

Megatron's local ``DotProductAttention`` materialises repeated K/V for GQA, the full [b, n, s, s] score
matrix, and refuses packed sequences. This module keeps megatron's interface and semantics and hands one
call to the provider's ``attention`` function:

    attention(q, k, v, *, scale, causal, mask, window, dropout_p, cu_seqlens_q=None, cu_seqlens_kv=None)

- sbhd: q [sq, b, nq, d], k [sk, b, nkv, d], v [sk, b, nkv, dv] -> [sq, b, nq * dv];
  thd (packed): q [t, nq, d], k [t, nkv, d], v [t, nkv, dv], cumulative lengths [n + 1] -> [t, nq * dv].
  dv differs from d under multi-latent attention (megatron passes ``k_channels`` / ``v_channels``, as to
  Transformer Engine's DotProductAttention).
- ``mask``: bool, True = masked out, broadcastable to [b, nq, sq, sk]; ``causal`` and ``window`` are
  bottom-right aligned (equal to top-left when sq == sk); ``window`` = (left, right), -1 = unbounded.

Mask semantics follow Transformer Engine's, which megatron's production path uses: ``causal`` builds the
causal mask and ignores ``attention_mask`` (the data loader's mask is that same causal mask);
``padding_causal`` combines both; ``padding`` and ``arbitrary`` use the mask as given. A query row with no
visible key has no defined output (flash kernels give 0, megatron's local softmax a uniform average);
train with such rows loss-masked.
"""

from __future__ import annotations

import math

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import is_layer_window_attention

from adapter.kernels import UnsupportedKernelSetting, context_parallel


def _check_ring_head_sizes(k_channels, v_channels, cp_size: int) -> None:
    """Ring attention takes one head size (context_parallel.RING_HEAD_SIZES); Ulysses any."""
    if context_parallel.ring_refuses(k_channels, v_channels, ["p2p"]):
        raise UnsupportedKernelSetting(
            f"context_parallel_size={cp_size}, cp_comm_type='p2p' with query/key head size {k_channels} != value "
            f"head size {v_channels} (multi-latent attention): {context_parallel.RING_HEAD_SIZES}; use "
            "cp_comm_type='a2a' or context_parallel_size=1")


class CoreAttention(MegatronModule):
    """megatron's core-attention interface; ``attention`` (and ``kernels``, the provider module, whose
    ``attention_with_lse`` / ``attention_grad_from_lse`` run ring attention's blocks) are bound per provider
    by ``adapter.kernels.core_attention_module``. With ``context_parallel_size`` > 1 it attends over the CP
    group as ``cp_comm_type`` says (adapter/kernels/context_parallel.py)."""

    attention = None
    kernels = None

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection: ProcessGroupCollection | None = None,
                 k_channels: int | None = None, v_channels: int | None = None):
        super().__init__(config=config)
        self.cp_group = self.cp_kind = None
        if config.context_parallel_size > 1:
            tp = config.tensor_model_parallel_size
            self.cp_kind = context_parallel.check_cp_attention(
                cp_comm_type or config.cp_comm_type, config.num_attention_heads // tp,
                (config.num_query_groups or config.num_attention_heads) // tp, config.context_parallel_size)
            if self.cp_kind == "p2p":
                _check_ring_head_sizes(k_channels, v_channels, config.context_parallel_size)
            self.cp_group = (pg_collection.cp if pg_collection is not None and hasattr(pg_collection, "cp")
                             else parallel_state.get_context_parallel_group())
        if config.softmax_type != "vanilla":
            raise UnsupportedKernelSetting(
                f"softmax_type={config.softmax_type!r}: flash attention computes the vanilla softmax; "
                "set softmax_type='vanilla' or use megatron's DotProductAttention")
        self.attn_mask_type = attn_mask_type
        self.layer_number = max(1, layer_number)
        # apply_query_key_layer_scaling divides the scale by the layer number and multiplies the scores
        # back inside megatron's softmax: the net scale is unchanged.
        # TE's default with separate sizes is 1/sqrt(key head size); MLA passes its own (YaRN's mscale in it).
        head_size = k_channels if k_channels is not None and v_channels is not None else config.kv_channels
        self.softmax_scale = 1.0 / math.sqrt(head_size) if softmax_scale is None else softmax_scale
        self.window = (tuple(config.window_size)
                       if is_layer_window_attention(config.window_size, config.window_attn_skip_freq,
                                                    self.layer_number) else None)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise UnsupportedKernelSetting(
                "attention_bias is not supported by the adapter's core attention; use megatron's "
                "DotProductAttention spec for biased attention")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        causal = mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal)
        mask = attention_mask if mask_type in (
            AttnMaskType.padding, AttnMaskType.padding_causal, AttnMaskType.arbitrary) else None
        if mask is not None and mask.dtype != torch.bool:
            raise UnsupportedKernelSetting(
                f"attention_mask of dtype {mask.dtype}: pass a bool mask, True = masked out (megatron's "
                "convention)")
        kwargs = dict(scale=self.softmax_scale, causal=causal, mask=mask, window=self.window,
                      dropout_p=self.dropout_p if self.training else 0.0)
        if self.cp_group is not None:
            return self._context_parallel(query, key, value, packed_seq_params, **kwargs)
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            kwargs.update(self._packed(packed_seq_params, mask))
        if kwargs["dropout_p"] > 0.0 and not self.config.sequence_parallel:
            # megatron draws attention dropout from the model-parallel RNG stream unless SP is on
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return self.attention(query, key, value, **kwargs)
        return self.attention(query, key, value, **kwargs)

    def _context_parallel(self, query, key, value, packed_seq_params, *, scale, causal, mask, window, dropout_p):
        """Attention over the CP group: causal (or full) self-attention of the load-balanced chunks only."""
        unsupported = [what for what, present in (
            ("packed (thd) sequences", packed_seq_params is not None and packed_seq_params.qkv_format == "thd"),
            ("an attention mask", mask is not None), (f"sliding window {window}", window is not None),
            (f"attention dropout {dropout_p}", dropout_p > 0.0), ("attention without the causal mask", not causal))
            if present]
        if unsupported:
            raise UnsupportedKernelSetting(
                f"{', '.join(unsupported)} with context_parallel_size={self.config.context_parallel_size}: the "
                "adapter's context-parallel attention is causal self-attention over megatron's load-balanced "
                "sequence split; use context_parallel_size=1 for these")
        if self.cp_kind == "a2a":
            return context_parallel.ulysses_attention(query, key, value, group=self.cp_group, attention=self.attention,
                                                      scale=scale, causal=True, mask=None, window=None, dropout_p=0.0)
        return context_parallel.ring_attention(query, key, value, scale=scale, group=self.cp_group,
                                               kernels=self.kernels)

    def _packed(self, params, mask) -> dict:
        if mask is not None:
            raise UnsupportedKernelSetting(
                "packed (thd) sequences take no attention_mask: their boundaries come from cu_seqlens; "
                "pass attention_mask=None")
        if self.window is not None:
            raise UnsupportedKernelSetting(
                f"sliding window {self.window} with packed (thd) sequences is not supported; unpack the "
                "batch or drop window_size")
        if self.config.apply_rope_fusion and self.config.rotary_interleaved:
            raise UnsupportedKernelSetting(
                "apply_rope_fusion with rotary_interleaved and packed (thd) sequences: megatron's fused "
                "thd RoPE interface carries no interleave flag, so the rotation would be wrong; set "
                "apply_rope_fusion=False")
        for padded, plain in ((params.cu_seqlens_q_padded, params.cu_seqlens_q),
                              (params.cu_seqlens_kv_padded, params.cu_seqlens_kv)):
            if padded is not None and padded is not plain and not torch.equal(padded, plain):
                raise UnsupportedKernelSetting(
                    "cu_seqlens_*_padded differ from cu_seqlens_*: padded packed sequences are not "
                    "supported; pack without per-sequence padding")
        return dict(cu_seqlens_q=params.cu_seqlens_q, cu_seqlens_kv=params.cu_seqlens_kv)

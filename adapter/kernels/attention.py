"""Core attention (megatron's ``core_attention`` submodule) over a provider's flash-attention function.

Megatron's local ``DotProductAttention`` materialises repeated K/V for GQA, the full [b, n, s, s] score
matrix, and refuses packed sequences. This module keeps megatron's interface and semantics and hands one
call to the provider's ``attention`` function:

    attention(q, k, v, *, scale, causal, mask, window, dropout_p, cu_seqlens_q=None, cu_seqlens_kv=None)

- sbhd: q [sq, b, nq, d], k/v [sk, b, nkv, d] -> [sq, b, nq * d];
  thd (packed): q [t, nq, d], k/v [t, nkv, d], cumulative lengths [n + 1] -> [t, nq * d].
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
from megatron.core import tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import is_layer_window_attention

from adapter.kernels import UnsupportedKernelSetting


class CoreAttention(MegatronModule):
    """megatron's core-attention interface; ``attention`` is bound per provider by
    ``adapter.kernels.core_attention_module``."""

    attention = None

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection: ProcessGroupCollection | None = None):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise UnsupportedKernelSetting(
                f"context_parallel_size={config.context_parallel_size}: the adapter's core attention has "
                "no context-parallel ring; use context_parallel_size=1 (or Transformer Engine's "
                "TEDotProductAttention on CUDA)")
        if config.softmax_type != "vanilla":
            raise UnsupportedKernelSetting(
                f"softmax_type={config.softmax_type!r}: flash attention computes the vanilla softmax; "
                "set softmax_type='vanilla' or use megatron's DotProductAttention")
        self.attn_mask_type = attn_mask_type
        self.layer_number = max(1, layer_number)
        # apply_query_key_layer_scaling divides the scale by the layer number and multiplies the scores
        # back inside megatron's softmax: the net scale is unchanged.
        self.softmax_scale = 1.0 / math.sqrt(config.kv_channels) if softmax_scale is None else softmax_scale
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
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            kwargs.update(self._packed(packed_seq_params, mask))
        if kwargs["dropout_p"] > 0.0 and not self.config.sequence_parallel:
            # megatron draws attention dropout from the model-parallel RNG stream unless SP is on
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return self.attention(query, key, value, **kwargs)
        return self.attention(query, key, value, **kwargs)

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

"""Qwen3.5 and Qwen3-Next: hybrid decoders (megatron's HybridModel, models/hybrid.py), as plain data.

Every layer is a token mixer and then an MLP (Qwen3.5 dense) or a MoE block (Qwen3.5-MoE, Qwen3-Next), each
behind a zero-centred RMSNorm (weights stored as gamma - 1, eps 1e-6). Three mixers in four are Gated DeltaNet
(linear attention: ``layer_types`` ``linear_attention``), every fourth softmax attention (``full_attention``,
HF ``full_attention_interval: 4``) with grouped query heads of 256, a zero-centred RMSNorm over each head's
queries and keys, RoPE over the first quarter of each head (``partial_rotary_factor: 0.25``) and the output
gated per head by sigmoid of a projection beside the queries (``attn_output_gate``). Gated DeltaNet: 16 key
heads and 32 value heads of 128, a causal convolution of width 4 over q, k and v, and its output normed per
value head (that norm's weight is stored as gamma itself) and gated by silu of a projection z. The MoE
blocks route to the top k of a softmax over the experts, renormalised, and add a shared expert gated by
sigmoid(x @ w).

The published sizes, and where their numbers come from (no model hub is reachable from here):

- ``qwen3.5-9b``: transformers' ``Qwen3_5TextConfig`` defaults (hidden 4096, 32 layers, FFN 12288, 16 query
  heads and 4 KV heads of 256); its docstring names Qwen/Qwen3.5-27B, but these numbers count 8.95B
  parameters: they are the 9B's shape.
- ``qwen3.5-35b-a3b``: ``Qwen3_5MoeTextConfig``'s defaults, documented as Qwen/Qwen3.5-35B-A3B (hidden 2048,
  40 layers, 16/2 heads, 256 experts of FFN 512, top 8, a shared expert of 512): 34.7B, 3.4B active.
- ``qwen3.5-397b-a17b`` (the flagship): the model card's facts (hidden 4096, 60 layers, 32/2 heads of 256,
  Gated DeltaNet with 16 key and 64 value heads of 128, 512 experts of FFN 1024, top 10 and one shared):
  396.4B, 17.4B active.
- ``qwen3-next-80b-a3b``: ``Qwen3NextConfig``'s defaults, documented as Qwen/Qwen3-Next-80B-A3B-Instruct
  (hidden 2048, 48 layers, 16/2 heads, 512 experts of FFN 512, top 10, a shared expert of 512, Qwen3's
  151,936-token vocabulary): 79.7B, 3.9B active.

``qwen3.5-bench`` is no published model: the GPU benchmark's size (bench/gpu_train.py, .ci/gpu_check.sh), the
35B-A3B's attention and Gated DeltaNet with a dense FFN of 6144 over 16 layers, 2.2B parameters (half of them
the embeddings), which the flow and transformers both train on one GPU.

RoPE base 10,000,000 and 262,144 positions are the published checkpoints' (transformers' defaults, 10,000 and
32,768, are placeholders); a converted checkpoint takes its own config.json's values in any case. ``tiny``,
``moe-tiny`` and Qwen3-Next's ``tiny`` are every feature at toy size for the tests (the sample corpus's
512-piece vocabulary).
"""

from __future__ import annotations

from .config import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig


def every_fourth_full(num_layers: int, interval: int = 4) -> tuple[str, ...]:
    """HF's default ``layer_types`` (``full_attention_interval`` 4): full attention at layers 3, 7, 11, ...,
    linear attention elsewhere."""
    return tuple(FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(num_layers))


_TINY = ModelConfig(num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
                    kv_channels=32, vocab_size=512, max_position_embeddings=512, seq_length=64, norm_epsilon=1e-6,
                    rotary_base=1e7, rotary_percent=0.25, qk_layernorm=True, attention_output_gate=True,
                    zero_centered_norm=True, layer_types=every_fourth_full(4), linear_key_head_dim=16,
                    linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4)
_MOE_TINY = _TINY.replace(num_experts=8, moe_ffn_hidden_size=32, moe_router_topk=2,
                          moe_shared_expert_intermediate_size=32, moe_shared_expert_gate=True,
                          moe_aux_loss_coeff=1e-3)

_PUBLISHED = dict(num_query_groups=2, kv_channels=256, vocab_size=248320, max_position_embeddings=262144,
                  seq_length=4096, norm_epsilon=1e-6, rotary_base=1e7, rotary_percent=0.25, qk_layernorm=True,
                  attention_output_gate=True, zero_centered_norm=True, moe_shared_expert_gate=True,
                  moe_aux_loss_coeff=1e-3)


def _published(num_layers: int, **sizes) -> ModelConfig:
    return ModelConfig(num_layers=num_layers, layer_types=every_fourth_full(num_layers), **{**_PUBLISHED, **sizes})


def _experts(num: int, topk: int, ffn: int) -> dict:
    return dict(num_experts=num, moe_router_topk=topk, moe_ffn_hidden_size=ffn,
                moe_shared_expert_intermediate_size=ffn)


FLAVORS = {
    "tiny": _TINY, "moe-tiny": _MOE_TINY,
    "9b": _published(32, hidden_size=4096, ffn_hidden_size=12288, num_attention_heads=16, num_query_groups=4,
                     moe_shared_expert_gate=False, moe_aux_loss_coeff=0.0),
    "35b-a3b": _published(40, hidden_size=2048, ffn_hidden_size=512, num_attention_heads=16, **_experts(256, 8, 512)),
    "bench": _published(16, hidden_size=2048, ffn_hidden_size=6144, num_attention_heads=16,
                         moe_shared_expert_gate=False, moe_aux_loss_coeff=0.0),
    "397b-a17b": _published(60, hidden_size=4096, ffn_hidden_size=1024, num_attention_heads=32,
                            linear_num_value_heads=64, **_experts(512, 10, 1024)),
}
NEXT_FLAVORS = {
    "tiny": _MOE_TINY,
    "80b-a3b": _published(48, hidden_size=2048, ffn_hidden_size=5632, num_attention_heads=16, vocab_size=151936,
                          **_experts(512, 10, 512)),
}

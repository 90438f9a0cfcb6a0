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

The published sizes are not listed yet; ``tiny``, ``moe-tiny`` and Qwen3-Next's ``tiny`` are every feature at
toy size for the tests (the sample corpus's 512-piece vocabulary).
"""

from __future__ import annotations

from .config import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig


def every_fourth_full(num_layers: int) -> tuple[str, ...]:
    """HF's default ``layer_types``: full attention at layers 3, 7, 11, ..., linear attention elsewhere."""
    return tuple(FULL_ATTENTION if (i + 1) % 4 == 0 else LINEAR_ATTENTION for i in range(num_layers))


_TINY = ModelConfig(num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
                    kv_channels=32, vocab_size=512, max_position_embeddings=512, seq_length=64, norm_epsilon=1e-6,
                    rotary_base=1e7, rotary_percent=0.25, qk_layernorm=True, attention_output_gate=True,
                    zero_centered_norm=True, layer_types=every_fourth_full(4), linear_key_head_dim=16,
                    linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4)
_MOE_TINY = _TINY.replace(num_experts=8, moe_ffn_hidden_size=32, moe_router_topk=2,
                          moe_shared_expert_intermediate_size=32, moe_shared_expert_gate=True,
                          moe_aux_loss_coeff=1e-3)

FLAVORS = {"tiny": _TINY, "moe-tiny": _MOE_TINY}
NEXT_FLAVORS = {"tiny": _MOE_TINY}

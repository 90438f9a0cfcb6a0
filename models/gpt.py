"""GPT named configs, as plain data.

``tiny`` and ``tiny-tied`` are the test and laptop sizes of a modern decoder (RMSNorm, SwiGLU, grouped
query attention, rotary embeddings, no linear biases). ``tiny-moe`` is the same decoder with a Mixture of
Experts in every layer: 8 experts of FFN 64, top-2 routing (softmax over the two chosen, as Mixtral and
Qwen3-MoE), 512 vocabulary rows and 64 positions so that the shipped sample corpus's 512-piece tokenizer and
scripts/pretrain_qwen_tiny.sh's sequence length fit; ``tiny-moe-shared`` adds a gated shared expert of FFN
128 and routes as Qwen2-MoE does (softmax over all experts, the top two not renormalised).

The others are the GPT-3 shapes Megatron-LM's examples train (Brown et al. 2020, "Language Models are
Few-Shot Learners", table 2.1): LayerNorm, GeLU, learned absolute positions, biases on every linear layer,
input and output embeddings tied, 2048 positions, FFN 4 x hidden, the GPT-2 BPE vocabulary of 50257 padded to
50304 (a multiple of 128, as Megatron-LM's ``--make-vocab-size-divisible-by 128`` pads it). The paper lists
24 heads for 1.3B with a head size of 128, which does not multiply to its hidden size 2048; 16 heads of 128
is what Megatron-LM's and NeMo's 1.3B configs use, and what is here.

| name | layers | hidden | heads | head size |
|------|--------|--------|-------|-----------|
| 125m | 12     | 768    | 12    | 64        |
| 350m | 24     | 1024   | 16    | 64        |
| 760m | 24     | 1536   | 16    | 96        |
| 1.3b | 24     | 2048   | 16    | 128       |
"""

from __future__ import annotations

from .config import ModelConfig

_TINY = ModelConfig(num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                    num_query_groups=2, vocab_size=256, max_position_embeddings=32, seq_length=32)
_TINY_MOE = _TINY.replace(vocab_size=512, max_position_embeddings=64, seq_length=64, num_experts=8,
                          moe_ffn_hidden_size=64, moe_router_topk=2)


def _gpt3(num_layers: int, hidden_size: int, num_attention_heads: int) -> ModelConfig:
    return ModelConfig(num_layers=num_layers, hidden_size=hidden_size, ffn_hidden_size=4 * hidden_size,
                       num_attention_heads=num_attention_heads, num_query_groups=num_attention_heads,
                       vocab_size=50304, max_position_embeddings=2048, seq_length=2048,
                       normalization="LayerNorm", norm_epsilon=1e-5, activation="gelu",
                       position_embedding="learned_absolute", add_qkv_bias=True, add_bias_linear=True,
                       tie_embeddings=True)


FLAVORS = {
    "tiny": _TINY,
    # input embedding and output layer share one weight, as in small Qwen2.5 models
    "tiny-tied": _TINY.replace(tie_embeddings=True),
    "tiny-moe": _TINY_MOE,
    "tiny-moe-shared": _TINY_MOE.replace(moe_shared_expert_intermediate_size=128, moe_shared_expert_gate=True,
                                         moe_router_pre_softmax=True),
    "125m": _gpt3(12, 768, 12),
    "350m": _gpt3(24, 1024, 16),
    "760m": _gpt3(24, 1536, 16),
    "1.3b": _gpt3(24, 2048, 16),
}

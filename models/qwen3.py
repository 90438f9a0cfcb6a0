"""Qwen3 and Qwen3-MoE named configs, as plain data.

Source: each model's published Hugging Face ``config.json``: the base model (huggingface.co/Qwen/Qwen3-<size>-Base)
where one is published, which is 0.6B to 14B and 30B-A3B; 32B and 235B-A22B were published only post-trained
(Qwen/Qwen3-32B, Qwen/Qwen3-235B-A22B), whose configs differ from a base model's only in
``max_position_embeddings`` (40960 against the bases' 32768).

| size | layers | hidden | FFN | heads | query groups | head size | experts (top-k, expert FFN) | positions | tied |
| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |
| 0.6B | 28 | 1024 | 3072 | 16 | 8 | 128 | - | 32768 | yes |
| 1.7B | 28 | 2048 | 6144 | 16 | 8 | 128 | - | 32768 | yes |
| 4B | 36 | 2560 | 9728 | 32 | 8 | 128 | - | 32768 | yes |
| 8B | 36 | 4096 | 12288 | 32 | 8 | 128 | - | 32768 | no |
| 14B | 40 | 5120 | 17408 | 40 | 8 | 128 | - | 32768 | no |
| 32B | 64 | 5120 | 25600 | 64 | 8 | 128 | - | 40960 | no |
| 30B-A3B | 48 | 2048 | 6144 | 32 | 4 | 128 | 128 (8, 768) | 32768 | no |
| 235B-A22B | 94 | 4096 | 12288 | 64 | 4 | 128 | 128 (8, 1536) | 40960 | no |

Every Qwen3 model: vocabulary 151936 rows, RMSNorm (eps 1e-6), SwiGLU, rotary embeddings (theta 1e6) over
the whole head, no bias on any linear layer (``attention_bias: false``), an RMSNorm over each head's queries
and keys before RoPE (QK-norm, megatron's ``qk_layernorm``), and a head size of 128 whatever hidden / heads is
(megatron's ``kv_channels``): 0.6B's 16 heads of 128 are 2048 wide against a hidden size of 1024.

Qwen3-MoE: every layer is a MoE layer (``decoder_sparse_step: 1``, ``mlp_only_layers: []``; the dense FFN
size is in config.json but unused), with 128 routed experts, no shared expert, the top 8 of a softmax over
all experts renormalised (``norm_topk_prob: true``: megatron's softmax after the top-k, module
``models.config``), and a load-balancing loss of coefficient 1e-3 (``router_aux_loss_coef``).
"""

from __future__ import annotations

from .config import ModelConfig


def _qwen3(num_layers, hidden_size, ffn_hidden_size, num_attention_heads, num_query_groups, tie_embeddings,
           max_position_embeddings=32768, **more) -> ModelConfig:
    return ModelConfig(num_layers=num_layers, hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size,
                       num_attention_heads=num_attention_heads, num_query_groups=num_query_groups,
                       kv_channels=128, vocab_size=151936, max_position_embeddings=max_position_embeddings,
                       seq_length=4096, normalization="RMSNorm", norm_epsilon=1e-6, activation="swiglu",
                       position_embedding="rope", rotary_base=1e6, add_qkv_bias=False, add_bias_linear=False,
                       qk_layernorm=True, tie_embeddings=tie_embeddings, **more)


def _qwen3_moe(num_layers, hidden_size, ffn_hidden_size, moe_ffn_hidden_size, num_attention_heads,
               num_query_groups, max_position_embeddings=32768) -> ModelConfig:
    return _qwen3(num_layers, hidden_size, ffn_hidden_size, num_attention_heads, num_query_groups, False,
                  max_position_embeddings, num_experts=128, moe_ffn_hidden_size=moe_ffn_hidden_size,
                  moe_router_topk=8, moe_aux_loss_coeff=1e-3)


# tests and the CPU demo: every Qwen3 feature at toy size, with the sample corpus's 512-piece vocabulary;
# heads of 32 against hidden / heads = 16 (a separate head size), GQA 2:1
_TINY = ModelConfig(num_layers=4, hidden_size=64, ffn_hidden_size=176, num_attention_heads=4, num_query_groups=2,
                    kv_channels=32, vocab_size=512, max_position_embeddings=512, seq_length=64,
                    norm_epsilon=1e-6, rotary_base=1e6, qk_layernorm=True, tie_embeddings=True)

FLAVORS = {
    "tiny": _TINY,
    # 8 experts of FFN 32, top 2 renormalised, untied: trains at EP 2 (4 experts a rank) on a CPU
    "moe-tiny": _TINY.replace(tie_embeddings=False, num_experts=8, moe_ffn_hidden_size=32, moe_router_topk=2,
                              moe_aux_loss_coeff=1e-3),
    "0.6b": _qwen3(28, 1024, 3072, 16, 8, True),
    "1.7b": _qwen3(28, 2048, 6144, 16, 8, True),
    "4b": _qwen3(36, 2560, 9728, 32, 8, True),
    "8b": _qwen3(36, 4096, 12288, 32, 8, False),
    "14b": _qwen3(40, 5120, 17408, 40, 8, False),
    "32b": _qwen3(64, 5120, 25600, 64, 8, False, max_position_embeddings=40960),
    "30b-a3b": _qwen3_moe(48, 2048, 6144, 768, 32, 4),
    "235b-a22b": _qwen3_moe(94, 4096, 12288, 1536, 64, 4, max_position_embeddings=40960),
}

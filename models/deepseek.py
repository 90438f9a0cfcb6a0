"""DeepSeek-V3 and Kimi-K2 named configs, as plain data: multi-latent attention, a dense-first Mixture of
Experts with a shared expert and DeepSeek's sigmoid router, and (DeepSeek-V3) a multi-token prediction layer.

Sources: the published Hugging Face ``config.json`` of deepseek-ai/DeepSeek-V3 and of moonshotai/Kimi-K2-Base
(Kimi-K2-Instruct has the same; the later Instruct-0905 doubles the YaRN factor to 64 for 256K positions).

| | DeepSeek-V3 | Kimi-K2 |
| --- | --- | --- |
| layers (dense first) | 61 (3) | 61 (1) |
| hidden / dense FFN | 7168 / 18432 | 7168 / 18432 |
| heads | 128 | 64 |
| MLA: q / kv LoRA rank, qk head (no RoPE + RoPE), v head | 1536 / 512, 128 + 64, 128 | the same |
| routed experts (top-k, FFN), shared experts | 256 (8, 2048), 1 | 384 (8, 2048), 1 |
| router groups (kept) | 8 (4) | 1 (1): plain top-k |
| routed scaling factor | 2.5 | 2.827 |
| vocabulary | 129280 | 163840 |
| RoPE theta, YaRN factor (original positions) | 10000, 40 (4096) | 50000, 32 (4096) |
| YaRN beta_fast / beta_slow, mscale / mscale_all_dim | 32 / 1, 1.0 / 1.0 | 1 / 1, 1.0 / 1.0 |
| positions | 163840 | 131072 |
| MTP layers (num_nextn_predict_layers) | 1 | 0 |

Both: RMSNorm (eps 1e-6) also over the query and key/value latents (megatron's ``qk_layernorm``), SwiGLU, no
bias on any linear layer, untied embeddings, sigmoid expert scores with DeepSeek's aux-loss-free balancing
(``e_score_correction_bias``: megatron's expert bias), the top 8 renormalised (``norm_topk_prob``) and scaled.
DeepSeek-V3 pairs it with a sequence-wise balance loss of factor 1e-4 (the paper's alpha; Megatron-LM's recipe:
``--moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-4``): the coefficient is the model's
here, the loss type a training argument. Kimi-K2 publishes none (0 here: its expert bias alone balances). DeepSeek-V3 has 671B parameters (37B activated) without its MTP
layer; Kimi-K2 1.03T (32B activated). megatron's MTP layer shares the model's embedding and output layer,
which Hugging Face's checkpoint stores again beside it (its 685B).

``deepseek-v3-tiny`` has every feature at toy size and trains on a CPU in minutes: 4 layers, the first dense,
MLA with a query LoRA, YaRN, 8 experts in 4 groups of which each token keeps 2, top 2, a shared expert, 1 MTP
layer, the sample corpus's 512-piece vocabulary.
"""

from __future__ import annotations

from .config import ModelConfig

_MLA = dict(multi_latent_attention=True, q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64,
            v_head_dim=128, qk_layernorm=True, mscale=1.0, mscale_all_dim=1.0, original_max_position_embeddings=4096)
_ROUTER = dict(moe_ffn_hidden_size=2048, moe_shared_expert_intermediate_size=2048, moe_router_topk=8,
               moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)


def _deepseek(num_attention_heads, num_experts, dense_layers, vocab_size, max_position_embeddings, **more):
    return ModelConfig(num_layers=61, hidden_size=7168, ffn_hidden_size=18432, num_attention_heads=num_attention_heads,
                       num_query_groups=num_attention_heads, vocab_size=vocab_size,
                       max_position_embeddings=max_position_embeddings, seq_length=4096, norm_epsilon=1e-6,
                       num_experts=num_experts, moe_layer_freq=(0,) * dense_layers + (1,) * (61 - dense_layers),
                       **_MLA, **_ROUTER, **more)


DEEPSEEK_FLAVORS = {
    "v3": _deepseek(128, 256, 3, 129280, 163840, rotary_base=10000.0, rotary_scaling_factor=40.0, beta_fast=32.0,
                    beta_slow=1.0, moe_router_num_groups=8, moe_router_group_topk=4, moe_router_topk_scaling_factor=2.5,
                    moe_aux_loss_coeff=1e-4, mtp_num_layers=1),
    "v3-tiny": ModelConfig(
        num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=4,
        vocab_size=512, max_position_embeddings=256, seq_length=64, norm_epsilon=1e-6, qk_layernorm=True,
        multi_latent_attention=True, q_lora_rank=32, kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8,
        v_head_dim=16, rotary_scaling_factor=4.0, mscale=1.0, mscale_all_dim=1.0, original_max_position_embeddings=64,
        num_experts=8, moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=32, moe_router_topk=2,
        moe_layer_freq=(0, 1, 1, 1), moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_num_groups=4, moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5, moe_aux_loss_coeff=1e-4,
        mtp_num_layers=1),
}

KIMI_FLAVORS = {
    "k2": _deepseek(64, 384, 1, 163840, 131072, rotary_base=50000.0, rotary_scaling_factor=32.0, beta_fast=1.0,
                    beta_slow=1.0, moe_router_topk_scaling_factor=2.827),
}

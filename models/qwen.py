"""Qwen2.5 named configs (the base models), as plain data.

Source: each model's published Hugging Face ``config.json`` (huggingface.co/Qwen/Qwen2.5-<size>/blob/main/
config.json, base models, not -Instruct). Instruct configs differ only where training does not see it
(``max_position_embeddings`` 32768, and ``rms_norm_eps`` 1e-6 for 14B-72B); convert an Instruct checkpoint
with its own config.json (``scripts/convert_checkpoint.py`` reads it) rather than with these names.

| size | layers | hidden | FFN | heads | query groups | vocab (padded) | positions | rope theta | RMSNorm eps | tied |
| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |
| 0.5B | 24 | 896 | 4864 | 14 | 2 | 151936 | 32768 | 1e6 | 1e-6 | yes |
| 1.5B | 28 | 1536 | 8960 | 12 | 2 | 151936 | 131072 | 1e6 | 1e-6 | yes |
| 3B | 36 | 2048 | 11008 | 16 | 2 | 151936 | 32768 | 1e6 | 1e-6 | yes |
| 7B | 28 | 3584 | 18944 | 28 | 4 | 152064 | 131072 | 1e6 | 1e-6 | no |
| 14B | 48 | 5120 | 13824 | 40 | 8 | 152064 | 131072 | 1e6 | 1e-5 | no |
| 32B | 64 | 5120 | 27648 | 40 | 8 | 152064 | 131072 | 1e6 | 1e-5 | no |
| 72B | 80 | 8192 | 29568 | 64 | 8 | 152064 | 131072 | 1e6 | 1e-5 | no |

Every Qwen2.5 model: RMSNorm, SwiGLU, rotary embeddings over the whole head, a bias on the query/key/value
projections and on no other linear layer, no sliding window (``use_sliding_window: false``). The tokenizer
has 151,665 entries; the embedding rows beyond it are padding. ``seq_length`` is the training length of
the 72B pretraining recipe (4096), capped by the model's positions.
"""

from __future__ import annotations

from .config import ModelConfig

HF_ARCHITECTURE = "Qwen2ForCausalLM"


def _qwen(num_layers, hidden_size, ffn_hidden_size, num_attention_heads, num_query_groups, vocab_size,
          max_position_embeddings, norm_epsilon, tie_embeddings, seq_length=4096) -> ModelConfig:
    return ModelConfig(num_layers=num_layers, hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size,
                       num_attention_heads=num_attention_heads, num_query_groups=num_query_groups,
                       vocab_size=vocab_size, max_position_embeddings=max_position_embeddings,
                       seq_length=seq_length, normalization="RMSNorm", norm_epsilon=norm_epsilon,
                       activation="swiglu", position_embedding="rope", rotary_base=1e6,
                       add_qkv_bias=True, add_bias_linear=False, tie_embeddings=tie_embeddings)


FLAVORS = {
    # tests and the CPU demo: every Qwen2.5 feature (QKV bias, GQA 2:1, tied embeddings) at toy size
    "tiny": _qwen(4, 64, 176, 4, 2, 512, 512, 1e-6, True, seq_length=64),
    "0.5b": _qwen(24, 896, 4864, 14, 2, 151936, 32768, 1e-6, True),
    "1.5b": _qwen(28, 1536, 8960, 12, 2, 151936, 131072, 1e-6, True),
    "3b": _qwen(36, 2048, 11008, 16, 2, 151936, 32768, 1e-6, True),
    "7b": _qwen(28, 3584, 18944, 28, 4, 152064, 131072, 1e-6, False),
    "14b": _qwen(48, 5120, 13824, 40, 8, 152064, 131072, 1e-5, False),
    "32b": _qwen(64, 5120, 27648, 40, 8, 152064, 131072, 1e-5, False),
    "72b": _qwen(80, 8192, 29568, 64, 8, 152064, 131072, 1e-5, False),
}

"""Tiny Hugging Face models built locally from configs (random weights, no hub), saved as safetensors."""

from __future__ import annotations

import json
from pathlib import Path

import torch

# name -> (architecture, config overrides): GQA 2:1 untied with QKV bias (Qwen2.5 7B-72B style),
# GQA 8:1 tied (two groups, so TP2 splits them) (Qwen2.5 0.5B-3B style), and a Llama (no biases)
TINY = {
    "qwen-gqa2-untied": ("Qwen2ForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2,
                                                  tie_word_embeddings=False)),
    "qwen-gqa8-tied": ("Qwen2ForCausalLM", dict(num_attention_heads=16, num_key_value_heads=2,
                                                tie_word_embeddings=True)),
    "llama-gqa2": ("LlamaForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2,
                                            tie_word_embeddings=False)),
}
TOKENIZER_CONFIG = {"model_max_length": 512, "tokenizer_class": "PreTrainedTokenizerFast"}


def save_tiny(name: str, directory: Path, seed: int = 0, dtype=torch.float32) -> Path:
    import transformers

    architecture, overrides = TINY[name]
    family = "Qwen2" if architecture.startswith("Qwen2") else "Llama"
    config = getattr(transformers, f"{family}Config")(
        vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=4,
        max_position_embeddings=512, rope_theta=1e6, rms_norm_eps=1e-6, **overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).to(dtype).eval()
    with torch.no_grad():  # HF initialises norms to 1 and biases to 0: make every tensor count
        for name_, p in model.named_parameters():
            if "norm" in name_ or name_.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(directory)
    (directory / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG))
    return directory


def hf_state(directory: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        out.update(load_file(file))
    return out

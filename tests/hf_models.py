"""Tiny Hugging Face models built locally from configs (random weights, no hub), saved as safetensors."""

from __future__ import annotations

import json
from pathlib import Path

import torch

# name -> (architecture, config overrides): GQA 2:1 untied with QKV bias (Qwen2.5 7B-72B style),
# GQA 8:1 tied (two groups, so TP2 splits them) (Qwen2.5 0.5B-3B style), a Llama (no biases), and Qwen3:
# heads of their own size (not hidden / heads), QK-norm, tied and untied, GQA 1:1 and 4:1, and the MoE with
# every layer sparse (top-2 renormalised) or one layer dense (top-2 not renormalised)
TINY = {
    "qwen-gqa2-untied": ("Qwen2ForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2,
                                                  tie_word_embeddings=False)),
    "qwen-gqa8-tied": ("Qwen2ForCausalLM", dict(num_attention_heads=16, num_key_value_heads=2,
                                                tie_word_embeddings=True)),
    "llama-gqa2": ("LlamaForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2,
                                            tie_word_embeddings=False)),
    "qwen3-gqa1-tied": ("Qwen3ForCausalLM", dict(num_attention_heads=4, num_key_value_heads=4, head_dim=32,
                                                 tie_word_embeddings=True)),
    "qwen3-gqa4-untied": ("Qwen3ForCausalLM", dict(num_attention_heads=8, num_key_value_heads=2, head_dim=24,
                                                   tie_word_embeddings=False)),
    "qwen3-moe": ("Qwen3MoeForCausalLM", dict(num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                                              num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                              norm_topk_prob=True, tie_word_embeddings=False)),
    "qwen3-moe-dense-layer": ("Qwen3MoeForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=4, head_dim=32, num_experts=6, num_experts_per_tok=2,
        moe_intermediate_size=48, norm_topk_prob=False, mlp_only_layers=[1], tie_word_embeddings=True)),
}
TOKENIZER_CONFIG = {"model_max_length": 512, "tokenizer_class": "PreTrainedTokenizerFast"}


def save_tiny(name: str, directory: Path, seed: int = 0, dtype=torch.float32) -> Path:
    import transformers

    architecture, overrides = TINY[name]
    config = getattr(transformers, architecture).config_class(
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


def convert_each(tmp_path_factory, names, save) -> dict:
    """Each named tiny HF model saved by ``save(name, directory)`` and converted once at TP2 x PP2 (the layout
    is recorded, not binding): name -> (hf dir, megatron dir, ModelConfig)."""
    from models.conversion import hf_to_mcore, read_hf_config

    out = {}
    for name in names:
        root = tmp_path_factory.mktemp(name)
        hf_dir = save(name, root / "hf")
        hf_to_mcore(hf_dir, root / "mcore", tp=2, pp=2, progress=False)
        out[name] = (hf_dir, root / "mcore", read_hf_config(hf_dir)[1])
    return out


def hf_state(directory: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        out.update(load_file(file))
    return out


# Hybrid models (Qwen3.5, Qwen3-Next; models/hf_hybrid.py), each feature at toy size: Gated DeltaNet with two
# value heads per key head, every fourth layer gated attention with partial RoPE; untied and tied; the MoE
# ones with a gated shared expert, Qwen3-Next's with one dense layer among the sparse ones and its top k not
# renormalised; and a multimodal Qwen3.5 (a vision tower, the language model under model.language_model.)
_HYBRID_SIZES = dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=32, linear_key_head_dim=16, linear_value_head_dim=16,
                     linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=512, rms_norm_eps=1e-6)
_HYBRID_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
HYBRID = {
    "qwen3.5": ("Qwen3_5ForCausalLM", dict(intermediate_size=128, tie_word_embeddings=False)),
    "qwen3.5-moe": ("Qwen3_5MoeForCausalLM", dict(**_HYBRID_MOE, tie_word_embeddings=True)),
    "qwen3-next": ("Qwen3NextForCausalLM", dict(**_HYBRID_MOE, intermediate_size=96, mlp_only_layers=[1],
                                                norm_topk_prob=False, tie_word_embeddings=False)),
}
_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
               temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)


def _perturbed(model, seed: int):
    """HF initialises zero-centred norms to 0 and Gated DeltaNet's to 1: make every tensor count."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "dt_bias" in name:
                p.add_(torch.randn(p.shape, generator=generator) * 0.1)
    return model


def save_tiny_hybrid(name: str, directory: Path, seed: int = 0, dtype=torch.float32) -> Path:
    import transformers

    architecture, overrides = HYBRID[name]
    config = getattr(transformers, architecture).config_class(**_HYBRID_SIZES, **overrides)
    torch.manual_seed(seed)
    model = _perturbed(getattr(transformers, architecture)(config).to(dtype).eval(), seed)
    model.save_pretrained(directory)
    (directory / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG))
    return directory


def save_tiny_multimodal(directory: Path, seed: int = 0) -> Path:
    """A Qwen3_5ForConditionalGeneration: HYBRID's dense Qwen3.5 as its language model, and a vision tower."""
    import transformers

    text = transformers.Qwen3_5TextConfig(**_HYBRID_SIZES, **HYBRID["qwen3.5"][1])
    config = transformers.Qwen3_5Config(text_config=text.to_dict(), vision_config=_VISION,
                                        tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = _perturbed(transformers.Qwen3_5ForConditionalGeneration(config).eval(), seed)
    model.save_pretrained(directory)
    return directory

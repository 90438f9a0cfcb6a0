"""What a Hugging Face checkpoint of a supported architecture is in megatron-core's terms: its config.json
as a ``ModelConfig``, and a declarative weight mapping between HF tensor names and megatron's checkpoint
keys (Megatron-Bridge style: one-to-one renames, the fused QKV projection, the gated MLP, each expert's).

Architectures: Qwen2 (QKV bias), Llama (no biases), Qwen3 (QK-norm, a head size of its own) and Qwen3-MoE
(Qwen3's attention, routed experts in every layer but ``mlp_only_layers``) here; the hybrid Qwen3.5,
Qwen3.5-MoE and Qwen3-Next in ``hf_hybrid``; DeepSeek-V3 and Kimi-K2 (multi-latent attention, MTP) in
``hf_deepseek``. The mapping primitives are ``weight_mappings``'.

Megatron keys are the ones megatron's ``sharded_state_dict`` gives, i.e. what a torch_dist checkpoint
holds: per-layer tensors under ``decoder.layers.<name>`` with a leading layer axis (under
``decoder.layers.<i>.<name>`` without one when dense and MoE layers mix), each expert's weights as one tensor
per layer with a leading expert axis (megatron's SequentialMLP and grouped experts alike, so a checkpoint
loads at any EP), and the local spec's norms under their Transformer Engine names
(``linear_qkv.layer_norm_weight``), so checkpoints move between the local and TE specs unchanged.
"""

from __future__ import annotations

from typing import Callable

import torch

from . import hf_deepseek, hf_hybrid
from .config import ModelConfig, ModelConfigError, moe_layer_freq_of
from .weight_mappings import Architecture, GatedMLP, QKV, Rename, UnsupportedCheckpoint


# ---------------------------------------------------------------------------------------------------------
# config.json <-> ModelConfig

def _rope_theta(hf: dict) -> float:
    if "rope_theta" in hf:
        return float(hf["rope_theta"])
    # transformers 5 writes rope settings under rope_parameters
    return float((hf.get("rope_parameters") or {}).get("rope_theta", 10000.0))


def _rope_scaling(hf: dict):
    scaling = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    return None if kind in (None, "default") else kind


def config_from_hf(hf: dict) -> ModelConfig:
    """The ModelConfig of a config.json of ``ARCHITECTURES`` (a multimodal Qwen3.5's: of its language model,
    ``hf_hybrid.language_model_config``); what megatron-core cannot express is refused by name."""
    architectures = hf.get("architectures") or [hf.get("model_type", "<none>")]
    architecture = architectures[0]
    if architecture in hf_deepseek.ARCHITECTURES:
        return hf_deepseek.config_from_hf(hf)
    if architecture not in ARCHITECTURES and architecture not in hf_hybrid.LANGUAGE_MODEL_OF:
        raise UnsupportedCheckpoint(
            f"architecture {architecture!r} (config.json 'architectures') is not supported: the converter "
            f"knows {', '.join([*ARCHITECTURES, *hf_hybrid.LANGUAGE_MODEL_OF])}")
    if architecture in hf_hybrid.LANGUAGE_MODEL_OF or architecture in hf_hybrid.ARCHITECTURES:
        text = hf_hybrid.language_model_config(hf)
        return hf_hybrid.config_from_hf(text, text["architectures"][0])
    if _rope_scaling(hf) is not None:
        raise UnsupportedCheckpoint(f"rope scaling {_rope_scaling(hf)!r} is not supported: only plain RoPE")
    if hf.get("use_sliding_window"):
        raise UnsupportedCheckpoint("use_sliding_window=true is not supported: megatron's GPT layer "
                                    "applies one window to every layer, Qwen2 and Qwen3 only to some")
    if hf.get("hidden_act", "silu") != "silu":
        raise UnsupportedCheckpoint(f"hidden_act={hf['hidden_act']!r} is not supported: only silu (SwiGLU)")
    if hf.get("mlp_bias") or (hf.get("attention_bias") and not architecture.startswith("Qwen2")):
        raise UnsupportedCheckpoint(f"{architecture} with attention_bias or mlp_bias is not supported: its output "
                                    "projection bias has no place in a model with QKV bias only")
    heads = hf["num_attention_heads"]
    positions = hf.get("max_position_embeddings", 4096)
    try:
        return ModelConfig(
            num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
            ffn_hidden_size=hf["intermediate_size"], num_attention_heads=heads,
            num_query_groups=hf.get("num_key_value_heads") or heads, kv_channels=hf.get("head_dim"),
            vocab_size=hf["vocab_size"], max_position_embeddings=positions, seq_length=min(4096, positions),
            normalization="RMSNorm", norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)), activation="swiglu",
            position_embedding="rope", rotary_base=_rope_theta(hf), add_bias_linear=False,
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            **ARCHITECTURES[architecture].settings(hf))
    except KeyError as exc:
        raise UnsupportedCheckpoint(f"config.json lacks {exc.args[0]!r}") from exc
    except ModelConfigError as exc:
        raise UnsupportedCheckpoint(f"config.json: {exc}") from exc


def _qwen3_moe_settings(hf: dict) -> dict:
    """Qwen3-MoE's experts in megatron's terms: HF's layer i is sparse unless listed in mlp_only_layers, when
    (i + 1) is a multiple of decoder_sparse_step; its router takes the top k of a softmax over all experts,
    renormalised when norm_topk_prob (megatron: the softmax after the top-k), else not (megatron's
    pre-softmax)."""
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    if not experts:
        raise UnsupportedCheckpoint("a Qwen3MoeForCausalLM config.json without num_experts: convert it as "
                                    "Qwen3ForCausalLM")
    return dict(qk_layernorm=True, add_qkv_bias=False, num_experts=experts,
                moe_ffn_hidden_size=hf["moe_intermediate_size"], moe_router_topk=hf["num_experts_per_tok"],
                moe_layer_freq=moe_layer_freq_of(hf),
                moe_router_pre_softmax=not hf.get("norm_topk_prob", False),
                moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.0)))


def config_to_hf(model: ModelConfig, architecture: str | None = None,
                 dtype: torch.dtype = torch.bfloat16) -> dict:
    """A config.json for ``model`` (used when a megatron checkpoint carries no original config.json), as
    ``architecture`` (default: ``architecture_for(model)``)."""
    architecture = architecture or architecture_for(model)
    if architecture in hf_hybrid.ARCHITECTURES:
        return {**hf_hybrid.config_json(model, architecture), "torch_dtype": str(dtype).removeprefix("torch.")}
    if architecture in hf_deepseek.ARCHITECTURES:
        return {**hf_deepseek.config_json(model), "torch_dtype": str(dtype).removeprefix("torch.")}
    if (model.normalization, model.activation, model.position_embedding, model.add_bias_linear) != (
            "RMSNorm", "swiglu", "rope", False):
        raise UnsupportedCheckpoint(
            f"this model (normalization {model.normalization}, activation {model.activation}, positions "
            f"{model.position_embedding}, linear biases {model.add_bias_linear}) has no {architecture} "
            "equivalent: only RMSNorm + SwiGLU + RoPE models without linear biases convert")
    if architecture not in ARCHITECTURES or architecture != architecture_for(model):
        raise UnsupportedCheckpoint(
            f"this model (add_qkv_bias={model.add_qkv_bias}, qk_layernorm={model.qk_layernorm}, num_experts="
            f"{model.num_experts}) does not fit {architecture}: it is a {architecture_for(model)}")
    config = {
        "architectures": [architecture], **ARCHITECTURES[architecture].config_json(model), "hidden_act": "silu",
        "num_hidden_layers": model.num_layers, "hidden_size": model.hidden_size,
        "intermediate_size": model.ffn_hidden_size, "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.num_query_groups, "vocab_size": model.vocab_size,
        "max_position_embeddings": model.max_position_embeddings, "rope_theta": model.rotary_base,
        "rms_norm_eps": model.norm_epsilon, "tie_word_embeddings": model.tie_embeddings,
        "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    return config


def _qwen3_config_json(model: ModelConfig) -> dict:
    return {"model_type": "qwen3", "head_dim": model.head_dim, "attention_bias": False, "use_sliding_window": False,
            "sliding_window": None, "max_window_layers": model.num_layers}


def _qwen3_moe_config_json(model: ModelConfig) -> dict:
    """Qwen3-MoE's fields for a megatron MoE model; a router or expert it has no field for is refused."""
    unsupported = [f"{name}={getattr(model, name)!r}" for name, plain in (
        ("moe_shared_expert_intermediate_size", None), ("moe_router_score_function", "softmax"),
        ("moe_router_topk_scaling_factor", None), ("moe_router_enable_expert_bias", False))
        if getattr(model, name) != plain]
    if unsupported:
        raise UnsupportedCheckpoint(f"{', '.join(unsupported)}: Qwen3MoeForCausalLM has routed experts and a "
                                    "softmax router only; keep this model as a megatron checkpoint")
    pattern = model.moe_layer_pattern()
    return {**_qwen3_config_json(model), "model_type": "qwen3_moe", "num_experts": model.num_experts,
            "num_experts_per_tok": model.moe_router_topk, "moe_intermediate_size": model.expert_ffn_hidden_size,
            "norm_topk_prob": not model.moe_router_pre_softmax, "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i, sparse in enumerate(pattern) if not sparse],
            "router_aux_loss_coef": model.moe_aux_loss_coeff, "output_router_logits": False}


# ---------------------------------------------------------------------------------------------------------
# weight mappings

_ALWAYS = lambda model: True  # noqa: E731
_HF_LAYER = "model.layers.{layer}."
_EMBEDDINGS = (
    (Rename("embedding.word_embeddings.weight", "model.embed_tokens.weight"), _ALWAYS),
    (Rename("decoder.final_layernorm.weight", "model.norm.weight"), _ALWAYS),
    (Rename("output_layer.weight", "lm_head.weight"), lambda model: not model.tie_embeddings),
)
_ATTENTION = (
    (Rename("self_attention.linear_qkv.layer_norm_weight", _HF_LAYER + "input_layernorm.weight"), _ALWAYS),
    (QKV("self_attention.linear_qkv.weight", *(_HF_LAYER + f"self_attn.{p}_proj.weight" for p in "qkv")), _ALWAYS),
    (QKV("self_attention.linear_qkv.bias", *(_HF_LAYER + f"self_attn.{p}_proj.bias" for p in "qkv")),
     lambda model: model.add_qkv_bias),
    (Rename("self_attention.q_layernorm.weight", _HF_LAYER + "self_attn.q_norm.weight"),
     lambda model: model.qk_layernorm),
    (Rename("self_attention.k_layernorm.weight", _HF_LAYER + "self_attn.k_norm.weight"),
     lambda model: model.qk_layernorm),
    (Rename("self_attention.linear_proj.weight", _HF_LAYER + "self_attn.o_proj.weight"), _ALWAYS),
    # megatron keeps the norm before the MLP under this name in dense and MoE layers alike
    (Rename("mlp.linear_fc1.layer_norm_weight", _HF_LAYER + "post_attention_layernorm.weight"), _ALWAYS),
)
_MLP = (
    (GatedMLP("mlp.linear_fc1.weight", _HF_LAYER + "mlp.gate_proj.weight", _HF_LAYER + "mlp.up_proj.weight"), _ALWAYS),
    (Rename("mlp.linear_fc2.weight", _HF_LAYER + "mlp.down_proj.weight"), _ALWAYS),
)
_HF_EXPERT = _HF_LAYER + "mlp.experts.{expert}."
# megatron's SequentialMLP and grouped experts checkpoint alike: one tensor per layer, an expert axis first
_QWEN3_MOE = (
    (Rename("mlp.router.weight", _HF_LAYER + "mlp.gate.weight"), _ALWAYS),
    (GatedMLP("mlp.experts.experts.linear_fc1.weight", _HF_EXPERT + "gate_proj.weight", _HF_EXPERT + "up_proj.weight"),
     _ALWAYS),
    (Rename("mlp.experts.experts.linear_fc2.weight", _HF_EXPERT + "down_proj.weight"), _ALWAYS),
)


def _fixed(**settings) -> Callable[[dict], dict]:
    return lambda hf: dict(settings)


_QWEN2_JSON = lambda model: {"model_type": "qwen2", "use_sliding_window": False, "sliding_window": None,  # noqa: E731
                             "max_window_layers": model.num_layers}
ARCHITECTURES = {
    "Qwen2ForCausalLM": Architecture("Qwen2ForCausalLM", _fixed(add_qkv_bias=True), _QWEN2_JSON,
                                     _EMBEDDINGS, _ATTENTION, _MLP),
    "LlamaForCausalLM": Architecture(
        "LlamaForCausalLM", _fixed(add_qkv_bias=False),
        lambda model: {"model_type": "llama", "attention_bias": False, "mlp_bias": False}, _EMBEDDINGS, _ATTENTION,
        _MLP),
    "Qwen3ForCausalLM": Architecture("Qwen3ForCausalLM", _fixed(add_qkv_bias=False, qk_layernorm=True),
                                     _qwen3_config_json, _EMBEDDINGS, _ATTENTION, _MLP),
    "Qwen3MoeForCausalLM": Architecture("Qwen3MoeForCausalLM", _qwen3_moe_settings, _qwen3_moe_config_json,
                                        _EMBEDDINGS, _ATTENTION, _MLP, _QWEN3_MOE),
    **hf_hybrid.ARCHITECTURES,
    **hf_deepseek.ARCHITECTURES,
}


def architecture_for(model: ModelConfig) -> str:
    """The HF architecture a megatron model of ``model`` is written back as."""
    if model.layer_types is not None:
        return hf_hybrid.architecture_for(model)
    if hf_deepseek.fits(model):
        return hf_deepseek.DEEPSEEK_V3
    if model.mtp_num_layers:
        raise UnsupportedCheckpoint(f"mtp_num_layers={model.mtp_num_layers} without multi-latent attention: the one "
                                    "Hugging Face architecture here with MTP layers is DeepSeek-V3's; keep this "
                                    "model as a megatron checkpoint")
    if model.qk_layernorm and not model.add_qkv_bias:
        return "Qwen3MoeForCausalLM" if model.num_experts is not None else "Qwen3ForCausalLM"
    if model.num_experts is not None or model.qk_layernorm:
        raise UnsupportedCheckpoint(
            f"no Hugging Face architecture here has num_experts={model.num_experts} with qk_layernorm="
            f"{model.qk_layernorm} and add_qkv_bias={model.add_qkv_bias}: the MoE one (Qwen3-MoE) needs QK-norm "
            "and no QKV bias; keep this model as a megatron checkpoint")
    return "Qwen2ForCausalLM" if model.add_qkv_bias else "LlamaForCausalLM"

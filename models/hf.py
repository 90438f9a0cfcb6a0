"""What a Hugging Face checkpoint of a supported architecture is in megatron-core's terms: its config.json
as a ``ModelConfig``, and a declarative weight mapping between HF tensor names and megatron's checkpoint
keys (Megatron-Bridge style: one-to-one renames, the fused QKV projection, the gated MLP).

Megatron keys are the ones megatron's ``sharded_state_dict`` gives, i.e. what a torch_dist checkpoint
holds: per-layer tensors under ``decoder.layers.<name>`` with a leading layer axis, and the local
spec's norms under their Transformer Engine names (``linear_qkv.layer_norm_weight``), so checkpoints
move between the local and TE specs unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from .config import ModelConfig, ModelConfigError

LAYER_PREFIX = "decoder.layers."


class UnsupportedCheckpoint(ValueError):
    """A Hugging Face checkpoint this converter cannot represent faithfully: names what and why."""


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
    """The ModelConfig of a Qwen2 or Llama config.json; what megatron's GPTModel cannot express is
    refused by name."""
    architectures = hf.get("architectures") or [hf.get("model_type", "<none>")]
    architecture = architectures[0]
    if architecture not in ARCHITECTURES:
        raise UnsupportedCheckpoint(
            f"architecture {architecture!r} (config.json 'architectures') is not supported: the converter "
            f"knows {', '.join(ARCHITECTURES)}")
    if _rope_scaling(hf) is not None:
        raise UnsupportedCheckpoint(f"rope scaling {_rope_scaling(hf)!r} is not supported: only plain RoPE")
    if hf.get("use_sliding_window"):
        raise UnsupportedCheckpoint("use_sliding_window=true is not supported: megatron's GPT layer "
                                    "applies one window to every layer, Qwen2 only to some")
    if hf.get("hidden_act", "silu") != "silu":
        raise UnsupportedCheckpoint(f"hidden_act={hf['hidden_act']!r} is not supported: only silu (SwiGLU)")
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    if head_dim * heads != hf["hidden_size"]:
        raise UnsupportedCheckpoint(f"head_dim={head_dim} x {heads} heads != hidden_size="
                                    f"{hf['hidden_size']}: a separate head size is not supported")
    qkv_bias = ARCHITECTURES[architecture].qkv_bias(hf)
    if architecture == "LlamaForCausalLM" and (hf.get("mlp_bias") or hf.get("attention_bias")):
        raise UnsupportedCheckpoint("Llama with attention_bias or mlp_bias is not supported: its output "
                                    "projection bias has no place in a model with QKV bias only")
    positions = hf.get("max_position_embeddings", 4096)
    try:
        return ModelConfig(
            num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
            ffn_hidden_size=hf["intermediate_size"], num_attention_heads=heads,
            num_query_groups=hf.get("num_key_value_heads") or heads, vocab_size=hf["vocab_size"],
            max_position_embeddings=positions, seq_length=min(4096, positions),
            normalization="RMSNorm", norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)), activation="swiglu",
            position_embedding="rope", rotary_base=_rope_theta(hf), add_qkv_bias=qkv_bias,
            add_bias_linear=False, tie_embeddings=bool(hf.get("tie_word_embeddings", False)))
    except KeyError as exc:
        raise UnsupportedCheckpoint(f"config.json lacks {exc.args[0]!r}") from exc
    except ModelConfigError as exc:
        raise UnsupportedCheckpoint(f"config.json: {exc}") from exc


def config_to_hf(model: ModelConfig, architecture: str = "Qwen2ForCausalLM",
                 dtype: torch.dtype = torch.bfloat16) -> dict:
    """A config.json for ``model`` (used when a megatron checkpoint carries no original config.json)."""
    if (model.normalization, model.activation, model.position_embedding, model.add_bias_linear) != (
            "RMSNorm", "swiglu", "rope", False):
        raise UnsupportedCheckpoint(
            f"this model (normalization {model.normalization}, activation {model.activation}, positions "
            f"{model.position_embedding}, linear biases {model.add_bias_linear}) has no {architecture} "
            "equivalent: only RMSNorm + SwiGLU + RoPE models without linear biases convert")
    if architecture == "LlamaForCausalLM" and not model.add_qkv_bias:
        extra = {"model_type": "llama", "attention_bias": False, "mlp_bias": False}
    elif architecture == "Qwen2ForCausalLM" and model.add_qkv_bias:
        extra = {"model_type": "qwen2", "use_sliding_window": False, "sliding_window": None,
                 "max_window_layers": model.num_layers}
    else:
        raise UnsupportedCheckpoint(f"add_qkv_bias={model.add_qkv_bias} does not fit {architecture}")
    return {
        "architectures": [architecture], **extra, "hidden_act": "silu",
        "num_hidden_layers": model.num_layers, "hidden_size": model.hidden_size,
        "intermediate_size": model.ffn_hidden_size, "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.num_query_groups, "vocab_size": model.vocab_size,
        "max_position_embeddings": model.max_position_embeddings, "rope_theta": model.rotary_base,
        "rms_norm_eps": model.norm_epsilon, "tie_word_embeddings": model.tie_embeddings,
        "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


# ---------------------------------------------------------------------------------------------------------
# weight mappings

@dataclasses.dataclass(frozen=True)
class Rename:
    """One HF tensor is one megatron tensor."""
    megatron: str
    hf: str

    def hf_names(self, layer: str) -> list[str]:
        return [self.hf.format(layer=layer)]

    def hf_shapes(self, model: ModelConfig, megatron_shape: tuple) -> list[tuple]:
        return [megatron_shape]

    def to_megatron(self, tensors: list[torch.Tensor], model: ModelConfig) -> torch.Tensor:
        return tensors[0]

    def to_hf(self, tensor: torch.Tensor, model: ModelConfig) -> list[torch.Tensor]:
        return [tensor]

    def row_range(self, index: int, megatron_rows: int) -> tuple[int, int]:
        return 0, megatron_rows


@dataclasses.dataclass(frozen=True)
class QKV:
    """HF's separate q/k/v projections <-> megatron's fused ``linear_qkv``, whose rows run per query group:
    that group's query heads, then its key head, then its value head (so a TP split by rows keeps whole
    groups together)."""
    megatron: str
    q: str
    k: str
    v: str

    def hf_names(self, layer: str) -> list[str]:
        return [name.format(layer=layer) for name in (self.q, self.k, self.v)]

    def hf_shapes(self, model: ModelConfig, megatron_shape: tuple) -> list[tuple]:
        d, rest = model.head_dim, tuple(megatron_shape[1:])
        return [(model.num_attention_heads * d, *rest), (model.num_query_groups * d, *rest),
                (model.num_query_groups * d, *rest)]

    def to_megatron(self, tensors: list[torch.Tensor], model: ModelConfig) -> torch.Tensor:
        q, k, v = tensors
        groups, d = model.num_query_groups, model.head_dim
        rest = q.shape[1:]
        per_group = [q.reshape(groups, -1, d, *rest), k.reshape(groups, 1, d, *rest),
                     v.reshape(groups, 1, d, *rest)]
        return torch.cat(per_group, dim=1).reshape(-1, *rest)

    def to_hf(self, tensor: torch.Tensor, model: ModelConfig) -> list[torch.Tensor]:
        groups, d = model.num_query_groups, model.head_dim
        per_group_heads = model.num_attention_heads // groups
        rest = tensor.shape[1:]
        grouped = tensor.reshape(groups, per_group_heads + 2, d, *rest)
        q, k, v = grouped.split([per_group_heads, 1, 1], dim=1)
        return [t.reshape(-1, *rest).contiguous() for t in (q, k, v)]

    def row_range(self, index: int, megatron_rows: int) -> None:
        return None  # q, k and v rows interleave per group


@dataclasses.dataclass(frozen=True)
class GatedMLP:
    """HF's gate and up projections <-> megatron's ``linear_fc1``: the gate half first (megatron's GLU
    applies the activation to the first half)."""
    megatron: str
    gate: str
    up: str

    def hf_names(self, layer: str) -> list[str]:
        return [self.gate.format(layer=layer), self.up.format(layer=layer)]

    def hf_shapes(self, model: ModelConfig, megatron_shape: tuple) -> list[tuple]:
        half = (megatron_shape[0] // 2, *megatron_shape[1:])
        return [half, half]

    def to_megatron(self, tensors: list[torch.Tensor], model: ModelConfig) -> torch.Tensor:
        return torch.cat(tensors, dim=0)

    def to_hf(self, tensor: torch.Tensor, model: ModelConfig) -> list[torch.Tensor]:
        return [t.contiguous() for t in tensor.chunk(2, dim=0)]

    def row_range(self, index: int, megatron_rows: int) -> tuple[int, int]:
        return index * megatron_rows // 2, megatron_rows // 2


# Each mapping also says which rows of the megatron tensor HF tensor ``index`` is (``row_range``: start
# and count, or None when its rows are scattered), so both directions can stream big tensors in row blocks.
Mapping = Rename | QKV | GatedMLP


@dataclasses.dataclass(frozen=True)
class Architecture:
    name: str
    qkv_bias: Callable[[dict], bool]
    # (mapping, included for this model?) pairs; per-layer names are relative to LAYER_PREFIX / {layer}
    embeddings: tuple
    layer: tuple

    def mappings(self, model: ModelConfig) -> tuple[list[Mapping], list[Mapping]]:
        """The (whole-model, per-layer) mappings that apply to ``model``: dense decoders only, so a MoE or
        QK-norm checkpoint is refused rather than written out without its experts or norms."""
        if model.num_experts or model.qk_layernorm:
            raise UnsupportedCheckpoint(
                f"{self.name} conversion maps dense models without QK-norm; this one has "
                f"num_experts={model.num_experts}, qk_layernorm={model.qk_layernorm} (Qwen3 and Qwen3-MoE "
                "conversion is not there yet): keep it as a megatron checkpoint")
        pick = lambda entries: [m for m, applies in entries if applies(model)]  # noqa: E731
        return pick(self.embeddings), pick(self.layer)


_ALWAYS = lambda model: True  # noqa: E731
_HF_LAYER = "model.layers.{layer}."


def _decoder_architecture(name: str, qkv_bias: Callable[[dict], bool]) -> Architecture:
    """Qwen2 and Llama share tensor names; they differ in which biases exist."""
    return Architecture(
        name=name, qkv_bias=qkv_bias,
        embeddings=(
            (Rename("embedding.word_embeddings.weight", "model.embed_tokens.weight"), _ALWAYS),
            (Rename("decoder.final_layernorm.weight", "model.norm.weight"), _ALWAYS),
            (Rename("output_layer.weight", "lm_head.weight"), lambda model: not model.tie_embeddings),
        ),
        layer=(
            (Rename("self_attention.linear_qkv.layer_norm_weight", _HF_LAYER + "input_layernorm.weight"),
             _ALWAYS),
            (QKV("self_attention.linear_qkv.weight", *(_HF_LAYER + f"self_attn.{p}_proj.weight"
                                                      for p in "qkv")), _ALWAYS),
            (QKV("self_attention.linear_qkv.bias", *(_HF_LAYER + f"self_attn.{p}_proj.bias" for p in "qkv")),
             lambda model: model.add_qkv_bias),
            (Rename("self_attention.linear_proj.weight", _HF_LAYER + "self_attn.o_proj.weight"), _ALWAYS),
            (Rename("mlp.linear_fc1.layer_norm_weight", _HF_LAYER + "post_attention_layernorm.weight"),
             _ALWAYS),
            (GatedMLP("mlp.linear_fc1.weight", _HF_LAYER + "mlp.gate_proj.weight",
                      _HF_LAYER + "mlp.up_proj.weight"), _ALWAYS),
            (Rename("mlp.linear_fc2.weight", _HF_LAYER + "mlp.down_proj.weight"), _ALWAYS),
        ))


ARCHITECTURES = {
    "Qwen2ForCausalLM": _decoder_architecture("Qwen2ForCausalLM", lambda hf: True),
    "LlamaForCausalLM": _decoder_architecture("LlamaForCausalLM", lambda hf: False),
}


def architecture_for(model: ModelConfig) -> str:
    """The HF architecture a megatron model of ``model`` is written back as."""
    return "Qwen2ForCausalLM" if model.add_qkv_bias else "LlamaForCausalLM"

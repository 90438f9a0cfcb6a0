"""Qwen3.5 (dense and MoE) and Qwen3-Next as Hugging Face checkpoints: their config.json as a hybrid
``ModelConfig`` and back, and their weights in megatron's hybrid layout (models/hybrid.py: HF layer ``i`` is
megatron's layers ``2i``, its token mixer, and ``2i + 1``, its MLP or MoE block).

The two families store Gated DeltaNet's input projection differently: Qwen3.5 as ``in_proj_qkv`` (all query
rows, then all key rows, then all value rows), ``in_proj_z``, ``in_proj_b`` and ``in_proj_a``; Qwen3-Next as
``in_proj_qkvz`` and ``in_proj_ba``, each interleaved per key head (that head's query, key, and the values and
z of its value heads; its b, then its a). megatron checkpoints each section (``in_proj.weight.query`` ...)
as a tensor of its own in Qwen3.5's order. Published Qwen3.5 checkpoints are multimodal
(``Qwen3_5ForConditionalGeneration``): the language model's tensors under ``model.language_model.``, its
config.json under ``text_config``; the language model is what converts.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from .config import FULL_ATTENTION, HYBRID_FIELDS, LINEAR_ATTENTION, ModelConfig, ModelConfigError, moe_layer_freq_of
from .qwen35 import every_fourth_full
from .weight_mappings import (GatedMLP, GatedQKV, Mapping, Rename, Sections, UnsupportedCheckpoint, ZeroCentred,
                              pick)

QWEN35, QWEN35_MOE, QWEN3_NEXT = "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM"
# multimodal checkpoints -> the architecture of their language model
LANGUAGE_MODEL_OF = {"Qwen3_5ForConditionalGeneration": QWEN35, "Qwen3_5MoeForConditionalGeneration": QWEN35_MOE}
# where a multimodal checkpoint keeps its language model's tensors, and where a CausalLM keeps them
MULTIMODAL_PREFIX, TEXT_PREFIX = "model.language_model.", "model."
# tensors of a published checkpoint the language model does not use: left, and said so in one line
LEFT_BEHIND = {"model.visual.": "the vision tower", "mtp.": "the multi-token prediction layers"}


# ---------------------------------------------------------------------------------------------------------
# config.json <-> ModelConfig

def language_model_config(hf: dict) -> dict:
    """A multimodal Qwen3.5 config.json's language model, as its CausalLM's config.json; others unchanged."""
    architecture = (hf.get("architectures") or [None])[0]
    if architecture not in LANGUAGE_MODEL_OF:
        return hf
    if not isinstance(hf.get("text_config"), dict):
        raise UnsupportedCheckpoint(f"a {architecture} config.json without text_config: it has no language model")
    text = hf["text_config"]  # transformers ties the multimodal model's output layer by the outer config's flag
    return {**text, "tie_word_embeddings": hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False)),
            "architectures": [LANGUAGE_MODEL_OF[architecture]]}


def _rope(hf: dict) -> tuple[float, float]:
    """(theta, partial rotary factor). Qwen3.5's multimodal RoPE (``mrope_section``) turns text tokens as
    plain RoPE does: their three position ids are one."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise UnsupportedCheckpoint(f"rope_type {kind!r} is not supported: only plain (partial) RoPE")
    theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
    return float(theta), float(hf.get("partial_rotary_factor", rope.get("partial_rotary_factor", 0.25)))


def _experts(hf: dict, architecture: str) -> dict:
    """The MoE fields: Qwen3.5-MoE routes every layer, renormalising its top k; Qwen3-Next as Qwen3-MoE does
    (``decoder_sparse_step``, ``mlp_only_layers``, ``norm_topk_prob``); both add a sigmoid-gated shared
    expert."""
    if architecture == QWEN35:
        return {}
    shared = hf.get("shared_expert_intermediate_size") or None
    return dict(num_experts=hf["num_experts"], moe_ffn_hidden_size=hf["moe_intermediate_size"],
                moe_router_topk=hf["num_experts_per_tok"], moe_layer_freq=moe_layer_freq_of(hf),
                moe_shared_expert_intermediate_size=shared, moe_shared_expert_gate=shared is not None,
                moe_router_pre_softmax=not hf.get("norm_topk_prob", True),
                moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.0)))


def config_from_hf(hf: dict, architecture: str) -> ModelConfig:
    """The hybrid ModelConfig of a Qwen3.5, Qwen3.5-MoE or Qwen3-Next (text) config.json."""
    if hf.get("hidden_act", "silu") != "silu" or hf.get("attention_bias"):
        raise UnsupportedCheckpoint("hidden_act other than silu, or attention_bias, is not supported")
    theta, partial = _rope(hf)
    layers, positions = hf["num_hidden_layers"], hf.get("max_position_embeddings", 32768)
    try:
        return ModelConfig(
            num_layers=layers, hidden_size=hf["hidden_size"],
            ffn_hidden_size=hf.get("intermediate_size") or hf["moe_intermediate_size"],
            num_attention_heads=hf["num_attention_heads"], num_query_groups=hf["num_key_value_heads"],
            kv_channels=hf.get("head_dim", 256), vocab_size=hf["vocab_size"], max_position_embeddings=positions,
            seq_length=min(4096, positions), norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)), rotary_base=theta,
            rotary_percent=partial, tie_embeddings=bool(hf.get("tie_word_embeddings", False)), qk_layernorm=True,
            attention_output_gate=True, zero_centered_norm=True,
            layer_types=tuple(hf.get("layer_types") or every_fourth_full(layers, hf.get("full_attention_interval", 4))),
            **{name: hf[name] for name in HYBRID_FIELDS if name in hf}, **_experts(hf, architecture))
    except KeyError as exc:
        raise UnsupportedCheckpoint(f"config.json lacks {exc.args[0]!r}") from exc
    except ModelConfigError as exc:
        raise UnsupportedCheckpoint(f"config.json: {exc}") from exc


def architecture_for(model: ModelConfig) -> str:
    """The HF architecture a hybrid model is written back as when its checkpoint carries no config.json:
    Qwen3.5, dense or MoE; Qwen3-Next where dense layers mix with MoE ones (Qwen3.5-MoE has no field for
    that)."""
    if model.num_experts is None:
        return QWEN35
    return QWEN35_MOE if all(model.moe_layer_pattern()) else QWEN3_NEXT


def config_json(model: ModelConfig, architecture: str) -> dict:
    """``model``'s config.json as ``architecture`` writes it: what transformers builds the same model from."""
    if model.layer_types is None:
        raise UnsupportedCheckpoint(f"{architecture} is a hybrid architecture; this model has no layer_types")
    if (architecture == QWEN35) != (model.num_experts is None) or (
            architecture == QWEN35_MOE and not all(model.moe_layer_pattern())):
        raise UnsupportedCheckpoint(f"this model (num_experts={model.num_experts}, MoE layers "
                                    f"{list(model.moe_layer_pattern())}) does not fit {architecture}: it is a "
                                    f"{architecture_for(model)}")
    config = {"model_type": "qwen3_5_text", "architectures": [architecture], "vocab_size": model.vocab_size,
              "hidden_size": model.hidden_size, "intermediate_size": model.ffn_hidden_size,
              "num_hidden_layers": model.num_layers, "num_attention_heads": model.num_attention_heads,
              "num_key_value_heads": model.num_query_groups, "head_dim": model.head_dim,
              "max_position_embeddings": model.max_position_embeddings, "rms_norm_eps": model.norm_epsilon,
              "tie_word_embeddings": model.tie_embeddings, "hidden_act": "silu", "attention_bias": False,
              "layer_types": list(model.layer_types),
              "rope_parameters": {"rope_type": "default", "rope_theta": model.rotary_base,
                                  "partial_rotary_factor": model.rotary_percent},
              **{name: getattr(model, name) for name in HYBRID_FIELDS}}
    if architecture == QWEN35:
        return config
    pattern = model.moe_layer_pattern()
    moe = {"num_experts": model.num_experts, "num_experts_per_tok": model.moe_router_topk,
           "moe_intermediate_size": model.expert_ffn_hidden_size,
           "shared_expert_intermediate_size": model.moe_shared_expert_intermediate_size or 0,
           "router_aux_loss_coef": model.moe_aux_loss_coeff}
    if architecture == QWEN35_MOE:
        return {**config, **moe, "model_type": "qwen3_5_moe_text"}
    return {**config, **moe, "model_type": "qwen3_next", "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i, sparse in enumerate(pattern) if not sparse],
            "norm_topk_prob": not model.moe_router_pre_softmax}


# ---------------------------------------------------------------------------------------------------------
# weights

_ALWAYS = lambda model: True  # noqa: E731
_LAYER = "model.layers.{layer}."
_GDN = _LAYER + "linear_attn."
_SECTION = "self_attention.{module}.weight.{section}"


def _sections(module: str, names: str) -> tuple[str, ...]:
    return tuple(_SECTION.format(module=module, section=section) for section in names.split())


def _qkv_rows(model: ModelConfig) -> list[int]:
    keys = model.linear_num_key_heads * model.linear_key_head_dim
    return [keys, keys, model.linear_num_value_heads * model.linear_value_head_dim]


def _side_by_side(rows: Callable[[ModelConfig], list[int]]) -> dict:
    """``Sections`` functions for one HF tensor holding the sections one after another."""
    return dict(split=lambda tensors, model: list(tensors[0].split(rows(model))),
                join=lambda tensors, model: [torch.cat(tensors)], hf_rows=lambda model: [sum(rows(model))])


def _per_key_head(rows: Callable[[ModelConfig], list[int]]) -> dict:
    """``Sections`` functions for one HF tensor interleaving the sections per key head (Qwen3-Next): rows
    ``rows(model)`` of each section, key head after key head."""
    def split(tensors, model):
        whole = tensors[0].reshape(model.linear_num_key_heads, -1, *tensors[0].shape[1:])
        return [part.reshape(-1, *whole.shape[2:]) for part in whole.split(rows(model), dim=1)]

    def join(tensors, model):
        heads = model.linear_num_key_heads
        rest = tensors[0].shape[1:]
        return [torch.cat([t.reshape(heads, -1, *rest) for t in tensors], dim=1).reshape(-1, *rest)]

    return dict(split=split, join=join, hf_rows=lambda model: [model.linear_num_key_heads * sum(rows(model))])


def _per_head_rows(*parts: str) -> Callable[[ModelConfig], list[int]]:
    """Rows per key head of each of ``parts`` (q, k: a key head; v, z: its value heads; b, a: one per value
    head)."""
    def rows(model):
        ratio = model.linear_num_value_heads // model.linear_num_key_heads
        key, value = model.linear_key_head_dim, ratio * model.linear_value_head_dim
        size = {"q": key, "k": key, "v": value, "z": value, "b": ratio, "a": ratio}
        return [size[part] for part in parts]
    return rows


_GDN_COMMON = (
    (Rename("input_layernorm.weight", _LAYER + "input_layernorm.weight"), _ALWAYS),
    *((Rename(f"self_attention.{name}", _GDN + name), _ALWAYS) for name in ("A_log", "dt_bias", "out_proj.weight")),
    (ZeroCentred("self_attention.out_norm.weight", _GDN + "norm.weight"), _ALWAYS),
    *((part, _ALWAYS) for part in Sections(_sections("conv1d", "query key value"), (_GDN + "conv1d.weight",),
                                           **_side_by_side(_qkv_rows)).parts()),
)
_QWEN35_IN_PROJ = (
    *((part, _ALWAYS) for part in Sections(_sections("in_proj", "query key value"), (_GDN + "in_proj_qkv.weight",),
                                           **_side_by_side(_qkv_rows)).parts()),
    *((Rename(_SECTION.format(module="in_proj", section=section), _GDN + f"in_proj_{hf}.weight"), _ALWAYS)
      for section, hf in (("z", "z"), ("beta", "b"), ("alpha", "a"))),
)
_QWEN3_NEXT_IN_PROJ = (
    *((part, _ALWAYS) for part in Sections(_sections("in_proj", "query key value z"), (_GDN + "in_proj_qkvz.weight",),
                                           **_per_key_head(_per_head_rows(*"qkvz"))).parts()),
    *((part, _ALWAYS) for part in Sections(_sections("in_proj", "beta alpha"), (_GDN + "in_proj_ba.weight",),
                                           **_per_key_head(_per_head_rows(*"ba"))).parts()),
)
_ATTENTION = (
    (Rename("input_layernorm.weight", _LAYER + "input_layernorm.weight"), _ALWAYS),
    (GatedQKV("self_attention.linear_qkv.weight", *(_LAYER + f"self_attn.{p}_proj.weight" for p in "qkv")), _ALWAYS),
    (Rename("self_attention.q_layernorm.weight", _LAYER + "self_attn.q_norm.weight"), _ALWAYS),
    (Rename("self_attention.k_layernorm.weight", _LAYER + "self_attn.k_norm.weight"), _ALWAYS),
    (Rename("self_attention.linear_proj.weight", _LAYER + "self_attn.o_proj.weight"), _ALWAYS),
)
_NORM = (Rename("pre_mlp_layernorm.weight", _LAYER + "post_attention_layernorm.weight"), _ALWAYS)
_MLP = (
    _NORM,
    (GatedMLP("mlp.linear_fc1.weight", _LAYER + "mlp.gate_proj.weight", _LAYER + "mlp.up_proj.weight"), _ALWAYS),
    (Rename("mlp.linear_fc2.weight", _LAYER + "mlp.down_proj.weight"), _ALWAYS),
)
_EXPERT, _SHARED = _LAYER + "mlp.experts.{expert}.", _LAYER + "mlp.shared_expert."
_has_shared = lambda model: model.moe_shared_expert_intermediate_size is not None  # noqa: E731
_MOE = (
    _NORM,
    (Rename("mlp.router.weight", _LAYER + "mlp.gate.weight"), _ALWAYS),
    (GatedMLP("mlp.experts.experts.linear_fc1.weight", _EXPERT + "gate_proj.weight", _EXPERT + "up_proj.weight"),
     _ALWAYS),
    (Rename("mlp.experts.experts.linear_fc2.weight", _EXPERT + "down_proj.weight"), _ALWAYS),
    (GatedMLP("mlp.shared_experts.linear_fc1.weight", _SHARED + "gate_proj.weight", _SHARED + "up_proj.weight"),
     _has_shared),
    (Rename("mlp.shared_experts.linear_fc2.weight", _SHARED + "down_proj.weight"), _has_shared),
    (Rename("mlp.shared_experts.gate_weight", _LAYER + "mlp.shared_expert_gate.weight"),
     lambda model: model.moe_shared_expert_gate),
)
_WHOLE = (
    (Rename("embedding.word_embeddings.weight", "model.embed_tokens.weight"), _ALWAYS),
    (Rename("decoder.final_norm.weight", "model.norm.weight"), _ALWAYS),
    (Rename("output_layer.weight", "lm_head.weight"), lambda model: not model.tie_embeddings),
)


@dataclasses.dataclass(frozen=True)
class HybridArchitecture:
    """A hybrid HF architecture: its name and its Gated DeltaNet input projection; the rest is shared."""
    name: str
    gated_delta_net_in_proj: tuple

    def settings(self, hf: dict) -> ModelConfig:
        return config_from_hf(hf, self.name)

    def config_json(self, model: ModelConfig) -> dict:
        return config_json(model, self.name)

    def whole(self, model: ModelConfig) -> list[Mapping]:
        return pick(_WHOLE, model)

    def layers(self, model: ModelConfig) -> list[tuple[int, list[Mapping]]]:
        """Per megatron layer: (its HF layer, its mappings); two megatron layers per HF layer."""
        if model.layer_types is None:
            raise UnsupportedCheckpoint(f"{self.name} is a hybrid architecture; this model has no layer_types")
        gated_delta_net = pick(_GDN_COMMON + self.gated_delta_net_in_proj, model)
        mixers = {LINEAR_ATTENTION: gated_delta_net, FULL_ATTENTION: pick(_ATTENTION, model)}
        blocks = {0: pick(_MLP, model), 1: pick(_MOE, model)}
        return [entry for i, (mixer, sparse) in enumerate(zip(model.layer_types, model.moe_layer_pattern()))
                for entry in ((i, mixers[mixer]), (i, blocks[sparse]))]


ARCHITECTURES = {QWEN35: HybridArchitecture(QWEN35, _QWEN35_IN_PROJ),
                 QWEN35_MOE: HybridArchitecture(QWEN35_MOE, _QWEN35_IN_PROJ),
                 QWEN3_NEXT: HybridArchitecture(QWEN3_NEXT, _QWEN3_NEXT_IN_PROJ)}

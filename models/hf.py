"""What a Hugging Face checkpoint of a supported architecture is in megatron-core's terms: its config.json
as a ``ModelConfig``, and a declarative weight mapping between HF tensor names and megatron's checkpoint
keys (Megatron-Bridge style: one-to-one renames, the fused QKV projection, the gated MLP, each expert's).

Architectures: Qwen2 (QKV bias), Llama (no biases), Qwen3 (QK-norm, a head size of its own) and Qwen3-MoE
(Qwen3's attention, routed experts in every layer but ``mlp_only_layers``).

Megatron keys are the ones megatron's ``sharded_state_dict`` gives, i.e. what a torch_dist checkpoint
holds: per-layer tensors under ``decoder.layers.<name>`` with a leading layer axis (under
``decoder.layers.<i>.<name>`` without one when dense and MoE layers mix), each expert's weights as one tensor
per layer with a leading expert axis (megatron's SequentialMLP and grouped experts alike, so a checkpoint
loads at any EP), and the local spec's norms under their Transformer Engine names
(``linear_qkv.layer_norm_weight``), so checkpoints move between the local and TE specs unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from .config import HYBRID_FIELDS, ModelConfig, ModelConfigError

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
    """The ModelConfig of a Qwen2, Llama, Qwen3 or Qwen3-MoE config.json; what megatron's GPTModel cannot
    express is refused by name."""
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
    step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or ())
    pattern = tuple(int(i not in dense and (i + 1) % step == 0) for i in range(hf["num_hidden_layers"]))
    return dict(qk_layernorm=True, add_qkv_bias=False, num_experts=experts,
                moe_ffn_hidden_size=hf["moe_intermediate_size"], moe_router_topk=hf["num_experts_per_tok"],
                moe_layer_freq=1 if all(pattern) else pattern,
                moe_router_pre_softmax=not hf.get("norm_topk_prob", False),
                moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.0)))


def config_to_hf(model: ModelConfig, architecture: str | None = None,
                 dtype: torch.dtype = torch.bfloat16) -> dict:
    """A config.json for ``model`` (used when a megatron checkpoint carries no original config.json), as
    ``architecture`` (default: ``architecture_for(model)``)."""
    architecture = architecture or architecture_for(model)
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

@dataclasses.dataclass(frozen=True)
class Rename:
    """One HF tensor is one megatron tensor. HF names hold ``{layer}`` and, for an expert's tensors,
    ``{expert}`` (whose megatron tensor has a leading expert axis)."""
    megatron: str
    hf: str

    def hf_names(self, layer: str, expert: str = "") -> list[str]:
        return [self.hf.format(layer=layer, expert=expert)]

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

    def hf_names(self, layer: str, expert: str = "") -> list[str]:
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
    applies the activation to the first half). Names as in ``Rename``."""
    megatron: str
    gate: str
    up: str

    def hf_names(self, layer: str, expert: str = "") -> list[str]:
        return [name.format(layer=layer, expert=expert) for name in (self.gate, self.up)]

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


def per_expert(mapping: Mapping) -> bool:
    """One megatron tensor per expert (an expert axis in the checkpoint, ``{expert}`` in the HF names)."""
    return any("{expert}" in name for name in dataclasses.astuple(mapping)[1:])


@dataclasses.dataclass(frozen=True)
class Architecture:
    """One HF architecture: its config.json fields beyond the shared ones (both ways) and its weights as
    (mapping, included for this model?) pairs; per-layer megatron names are relative to LAYER_PREFIX, HF
    names hold {layer} (and {expert})."""
    name: str
    settings: Callable[[dict], dict]  # config.json -> ModelConfig fields of this architecture
    config_json: Callable[[ModelConfig], dict]  # ModelConfig -> config.json fields of this architecture
    embeddings: tuple
    layer: tuple  # attention and norms: every layer
    mlp: tuple  # a dense layer's MLP
    moe: tuple = ()  # a MoE layer's router and experts

    def mappings(self, model: ModelConfig) -> tuple[list[Mapping], list[Mapping], list[Mapping]]:
        """The (whole-model, dense-layer, MoE-layer) mappings that apply to ``model``."""
        if model.num_experts is not None and not self.moe:
            raise UnsupportedCheckpoint(f"{self.name} has no experts, this model has num_experts="
                                        f"{model.num_experts}: convert it as a MoE architecture or keep it as "
                                        "a megatron checkpoint")
        pick = lambda entries: [m for m, applies in entries if applies(model)]  # noqa: E731
        layer = pick(self.layer)
        return pick(self.embeddings), layer + pick(self.mlp), layer + pick(self.moe)


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
}


def hybrid_config_json(model: ModelConfig) -> dict:
    """The text config.json of a hybrid ``model`` as Qwen3.5 writes it (``Qwen3_5TextConfig``, and
    ``Qwen3_5MoeTextConfig`` with experts): what transformers builds the same model from. Its weights do not
    convert yet (``architecture_for``)."""
    if model.layer_types is None:
        raise UnsupportedCheckpoint("hybrid_config_json takes a hybrid model (layer_types set)")
    config = {"model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"],
              "vocab_size": model.vocab_size, "hidden_size": model.hidden_size,
              "intermediate_size": model.ffn_hidden_size, "num_hidden_layers": model.num_layers,
              "num_attention_heads": model.num_attention_heads, "num_key_value_heads": model.num_query_groups,
              "head_dim": model.head_dim, "max_position_embeddings": model.max_position_embeddings,
              "rms_norm_eps": model.norm_epsilon, "tie_word_embeddings": model.tie_embeddings, "hidden_act": "silu",
              "layer_types": list(model.layer_types), "attention_bias": False,
              "rope_parameters": {"rope_type": "default", "rope_theta": model.rotary_base,
                                  "partial_rotary_factor": model.rotary_percent},
              **{name: getattr(model, name) for name in HYBRID_FIELDS}}
    if model.num_experts is None:
        return config
    return {**config, "model_type": "qwen3_5_moe_text", "architectures": ["Qwen3_5MoeForCausalLM"],
            "num_experts": model.num_experts, "num_experts_per_tok": model.moe_router_topk,
            "moe_intermediate_size": model.expert_ffn_hidden_size,
            "shared_expert_intermediate_size": model.moe_shared_expert_intermediate_size,
            "router_aux_loss_coef": model.moe_aux_loss_coeff}


def architecture_for(model: ModelConfig) -> str:
    """The HF architecture a megatron model of ``model`` is written back as."""
    if model.layer_types is not None:
        raise UnsupportedCheckpoint(
            "a hybrid model's (Gated DeltaNet, layer_types) weights do not convert to Hugging Face yet: keep it as a "
            "megatron checkpoint")
    if model.qk_layernorm and not model.add_qkv_bias:
        return "Qwen3MoeForCausalLM" if model.num_experts is not None else "Qwen3ForCausalLM"
    if model.num_experts is not None or model.qk_layernorm:
        raise UnsupportedCheckpoint(
            f"no Hugging Face architecture here has num_experts={model.num_experts} with qk_layernorm="
            f"{model.qk_layernorm} and add_qkv_bias={model.add_qkv_bias}: the MoE one (Qwen3-MoE) needs QK-norm "
            "and no QKV bias; keep this model as a megatron checkpoint")
    return "Qwen2ForCausalLM" if model.add_qkv_bias else "LlamaForCausalLM"

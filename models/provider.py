"""megatron-core GPTModels from a ``ModelConfig``: the TransformerConfig, the layer spec, the model chunk
for a pipeline rank, and a Megatron-LM-shaped ``model_provider(pre_process, post_process, vp_stage)``.

The layer spec is megatron's own ``get_gpt_layer_local_spec``: with ``import adapter`` it yields the
kernel provider's norm and core attention (patches/kernels.py), so the same spec serves every backend. A
Mixture-of-Experts model gets megatron's own ``get_gpt_decoder_block_spec`` over the same local layer specs:
it places MoE and dense layers as ``moe_layer_freq`` says and keeps this pipeline stage's, and its MoE layers
use megatron's grouped experts (``TEGroupedMLP`` over the kernel provider's grouped GEMM) when the config
says ``moe_grouped_gemm``, else ``SequentialMLP``; both checkpoint under the same keys. Multi-latent attention
is megatron's ``MLATransformerConfig`` and the same specs' MLA layers (``MLASelfAttention``, the provider's core
attention taking its separate key and value head sizes); multi-token prediction is megatron's MTP block over
the last decoder layer's spec, as Megatron-LM's gpt_builders builds it: the GPTModel adds its loss.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_gpt_mtp_block_spec,
)
from megatron.core.transformer import MLATransformerConfig, TransformerConfig

from adapter.parallel import PipelineSplit

from . import get as named_model
from .config import HYBRID_FIELDS, MLA_FIELDS, ModelConfig, ModelConfigError
from .hybrid import build_hybrid_model

_ACTIVATIONS = {"swiglu": (F.silu, True), "gelu": (F.gelu, False)}


def transformer_config(model: ModelConfig, **overrides) -> TransformerConfig:
    """The TransformerConfig of ``model`` on the model-parallel layout already initialised.

    ``overrides`` are TransformerConfig fields (parallel sizes, dtypes, fusion flags, recompute, ...)."""
    activation, gated = _ACTIVATIONS[model.activation]
    settings = dict(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.head_dim,
        normalization=model.normalization,
        layernorm_epsilon=model.norm_epsilon,
        gated_linear_unit=gated,
        activation_func=activation,
        add_bias_linear=model.add_bias_linear,
        add_qkv_bias=model.add_qkv_bias,
        qk_layernorm=model.qk_layernorm,
        attention_output_gate=model.attention_output_gate,
        layernorm_zero_centered_gamma=model.zero_centered_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.02,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        virtual_pipeline_model_parallel_size=(
            parallel_state.get_virtual_pipeline_model_parallel_world_size()),
        pipeline_dtype=torch.float32,
        # The same full weights on every layout: megatron initialises the master weight on CPU and
        # splits it, so a seed gives one model whatever the TP/PP.
        use_cpu_initialization=True,
        cuda_graph_scope=[],  # megatron's default, "full", is deprecated and warns in every config
    )
    if model.num_experts is not None:
        settings.update(_moe_settings(model))
    if model.layer_types is not None:
        settings.update(_hybrid_settings(model))
    if model.mtp_num_layers is not None:
        settings["mtp_num_layers"] = model.mtp_num_layers
    if model.multi_latent_attention:
        settings.update(_latent_attention_settings(model))
    settings.update(overrides)
    model.check_layout(settings["tensor_model_parallel_size"], settings["pipeline_model_parallel_size"],
                       settings["virtual_pipeline_model_parallel_size"], settings.get("expert_model_parallel_size", 1),
                       settings.get("expert_tensor_parallel_size"), split=_pipeline_split(settings))
    return (MLATransformerConfig if model.multi_latent_attention else TransformerConfig)(**settings)


def _latent_attention_settings(model: ModelConfig) -> dict:
    """MLATransformerConfig's fields: MLA's sizes and its YaRN RoPE (megatron's MLA turns its own rotary
    embedding, from rotary_base and rotary_percent too; GPTModel builds none beside it)."""
    return dict(multi_latent_attention=True, rope_type="yarn", rotary_base=model.rotary_base,
                rotary_percent=model.rotary_percent, **{name: getattr(model, name) for name in MLA_FIELDS})


def _pipeline_split(settings: dict) -> PipelineSplit:
    """The uneven pipeline split the TransformerConfig settings ask for (Megatron-LM's fields), if any."""
    return PipelineSplit(first=settings.get("num_layers_in_first_pipeline_stage"),
                         last=settings.get("num_layers_in_last_pipeline_stage"),
                         embedding=bool(settings.get("account_for_embedding_in_pipeline_split")),
                         loss=bool(settings.get("account_for_loss_in_pipeline_split")))


def _moe_settings(model: ModelConfig) -> dict:
    """The TransformerConfig fields of the experts and the router; the expert-parallel sizes default to the
    initialised groups, like the other parallel sizes."""
    layer_freq = model.moe_layer_freq
    return dict(
        num_moe_experts=model.num_experts,
        moe_ffn_hidden_size=model.expert_ffn_hidden_size,
        moe_router_topk=model.moe_router_topk,
        moe_layer_freq=list(layer_freq) if isinstance(layer_freq, tuple) else layer_freq,
        moe_shared_expert_intermediate_size=model.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=model.moe_shared_expert_gate,
        moe_router_score_function=model.moe_router_score_function,
        moe_router_pre_softmax=model.moe_router_pre_softmax,
        moe_router_topk_scaling_factor=model.moe_router_topk_scaling_factor,
        moe_router_enable_expert_bias=model.moe_router_enable_expert_bias,
        moe_aux_loss_coeff=model.moe_aux_loss_coeff,
        moe_router_num_groups=model.moe_router_num_groups,
        moe_router_group_topk=model.moe_router_group_topk,
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=parallel_state.get_expert_tensor_parallel_world_size(),
    )


def _hybrid_settings(model: ModelConfig) -> dict:
    """A hybrid model's TransformerConfig fields: megatron counts the token mixers and the MLP blocks as
    layers of their own (models/hybrid.py); Gated DeltaNet's sizes."""
    return dict(num_layers=2 * model.num_layers, **{name: getattr(model, name) for name in HYBRID_FIELDS})


def build_model(model: ModelConfig, config: TransformerConfig, vp_stage: int | None = None,
                pre_process: bool | None = None, post_process: bool | None = None) -> GPTModel:
    """The GPTModel chunk of this pipeline rank (and virtual stage ``vp_stage``)."""
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    if model.layer_types is not None:
        return build_hybrid_model(model, config, vp_stage, pre_process, post_process)
    if model.num_experts is None:
        spec = get_gpt_layer_local_spec(normalization=model.normalization, qk_layernorm=model.qk_layernorm,
                                        multi_latent_attention=model.multi_latent_attention)
    else:
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=model.normalization,
                                          vp_stage=vp_stage)
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=model.vocab_size,
        max_sequence_length=model.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=model.tie_embeddings,
        position_embedding_type=model.position_embedding,
        rotary_base=model.rotary_base,
        mtp_block_spec=_mtp_block_spec(model, config, spec, vp_stage),
        vp_stage=vp_stage,
    )


def _mtp_block_spec(model: ModelConfig, config: TransformerConfig, spec, vp_stage: int | None):
    """megatron's MTP block spec for this stage (None where it holds no MTP layer, or the model has none):
    each MTP layer is the model's last decoder layer, as in Megatron-LM's gpt_builders. MTP layers live on the
    last stage, whose block spec ends with that layer; where an uneven split leaves it none, a MoE layer's."""
    if model.mtp_num_layers is None:
        return None
    if getattr(spec, "layer_specs", True) == []:
        spec = get_gpt_layer_local_spec(num_experts=model.num_experts, normalization=model.normalization,
                                        qk_layernorm=model.qk_layernorm,
                                        multi_latent_attention=model.multi_latent_attention)
    return get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False, vp_stage=vp_stage)


def make_model_provider(model: ModelConfig | str, **config_overrides):
    """``model_provider(pre_process=True, post_process=True, vp_stage=None)`` as Megatron-LM's pretrain
    calls it, for a ModelConfig or a model name; ``config_overrides`` go to the TransformerConfig."""
    if isinstance(model, str):
        model = named_model(model)

    def model_provider(pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None):
        return build_model(model, transformer_config(model, **config_overrides), vp_stage=vp_stage,
                           pre_process=pre_process, post_process=post_process)

    return model_provider


# Megatron-LM argument name -> ModelConfig field, for the arguments that carry over unchanged.
_ARG_FIELDS = {
    "num_layers": "num_layers", "hidden_size": "hidden_size", "ffn_hidden_size": "ffn_hidden_size",
    "num_attention_heads": "num_attention_heads", "kv_channels": "kv_channels",
    "max_position_embeddings": "max_position_embeddings",
    "seq_length": "seq_length", "normalization": "normalization", "norm_epsilon": "norm_epsilon",
    "position_embedding_type": "position_embedding", "rotary_base": "rotary_base",
    "num_experts": "num_experts", "moe_ffn_hidden_size": "moe_ffn_hidden_size",
    "moe_router_topk": "moe_router_topk", "moe_layer_freq": "moe_layer_freq",
    "moe_shared_expert_intermediate_size": "moe_shared_expert_intermediate_size",
    "moe_router_score_function": "moe_router_score_function",
    "moe_router_topk_scaling_factor": "moe_router_topk_scaling_factor",
    "mtp_num_layers": "mtp_num_layers",
    **{name: name for name in MLA_FIELDS},
}
# Megatron-LM's switches that are ModelConfig fields of the same meaning.
_SWITCH_FIELDS = ("qk_layernorm", "moe_shared_expert_gate", "moe_router_pre_softmax", "moe_router_enable_expert_bias",
                  "multi_latent_attention")


def config_from_args(args: argparse.Namespace) -> ModelConfig:
    """A ModelConfig from Megatron-LM-named arguments: ``args.model`` (a name from ``models.names()``)
    when set, with every architecture argument the namespace sets (not None) applied over it.

    Megatron-LM's switches (--swiglu, --disable-bias-linear, --add-qkv-bias, --group-query-attention,
    --untie-embeddings-and-output-weights, --qk-layernorm, --moe-shared-expert-gate, ...) default to False,
    which cannot be told from "not given": over a named model only a switch that is on changes it; without
    one, they are read as they are. ``--num-experts 0`` means a dense model, as in Megatron-LM: over a named
    MoE model it drops the named model's expert settings."""
    name = getattr(args, "model", None)
    settings = dict(vars(named_model(name))) if name else {}
    given = {k: v for k, v in vars(args).items() if v is not None}
    if given.get("num_experts") == 0:
        settings = {k: v for k, v in settings.items() if not k.startswith("moe_")}
        given["num_experts"] = None
    settings.update({field: given[arg] for arg, field in _ARG_FIELDS.items() if arg in given})

    def switch(arg: str):
        value = given.get(arg)
        return value if value or not name else None

    gqa = switch("group_query_attention")
    if gqa or (gqa is None and not name and "num_query_groups" in given):
        settings["num_query_groups"] = given.get("num_query_groups")
    elif gqa is False and "num_attention_heads" in settings:
        settings["num_query_groups"] = settings["num_attention_heads"]
    vocab = given.get("padded_vocab_size", given.get("vocab_size"))
    if vocab is not None:
        settings["vocab_size"] = vocab
    for arg, field, meaning in (("swiglu", "activation", lambda on: "swiglu" if on else "gelu"),
                                ("disable_bias_linear", "add_bias_linear", lambda on: not on),
                                ("add_qkv_bias", "add_qkv_bias", bool),
                                ("untie_embeddings_and_output_weights", "tie_embeddings", lambda on: not on),
                                *((field, field, bool) for field in _SWITCH_FIELDS)):
        value = switch(arg)
        if value is not None:
            settings[field] = meaning(value)
    settings.setdefault("max_position_embeddings", settings.get("seq_length"))
    try:
        return ModelConfig(**settings)
    except TypeError as exc:
        raise ModelConfigError(f"the arguments do not describe a whole model ({exc}): pass --model NAME "
                               f"or every architecture argument") from exc

"""The GPT model provider megatron.training's ``pretrain`` takes before 0.19 (``flow.releases``). Megatron-LM keeps
its GPT builder beside its script (gpt_builders.py, model_provider.py), out of the megatron-core wheel; from 0.19
megatron.training builds the model from the GPT config itself.

Written from megatron-core's interfaces, it chooses the layer spec as Megatron-LM's builder does at core_v0.16.1
to core_v0.18.2 (``--spec``, an experimental attention variant, MoE's decoder block, a heterogeneous layers
config, else one layer spec per ``--transformer-impl``; MTP's block from the last decoder layer) and gives
``GPTModel`` the same arguments, so the same flags build the same model and train to the same losses.
"""

from __future__ import annotations

import inspect

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt import gpt_layer_specs as specs
from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
    get_transformer_block_with_experimental_attention_variant_spec,
)
from megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs import get_gpt_heterogeneous_layer_spec
from megatron.core.transformer.spec_utils import import_module
from megatron.training import get_args, print_rank_0
from megatron.training.arguments import core_transformer_config_from_args
from megatron.training.yaml_arguments import core_transformer_config_from_yaml

from adapter.input_refusals import InputRefused

# the config fields Megatron-LM's builder hands each layer spec by keyword, those the installed release's spec
# function takes (moe_use_legacy_grouped_gemm up to 0.16, use_grouped_gemm_for_dense_mlp from 0.18)
_LOCAL_KEYWORDS = ("normalization", "moe_use_legacy_grouped_gemm", "use_kitchen", "use_kitchen_attention",
                   "kitchen_attention_backend")
_TE_KEYWORDS = ("moe_use_legacy_grouped_gemm", "qk_l2_norm", "use_kitchen", "use_te_activation_func",
                "use_kitchen_attention", "kitchen_attention_backend", "mla_down_proj_fusion",
                "use_grouped_gemm_for_dense_mlp")


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None) -> GPTModel:
    """The GPT model (or this pipeline stage's part of it) of megatron.training's arguments."""
    args = get_args()
    if getattr(args, "use_legacy_models", False):
        raise InputRefused("--use-legacy-models: scripts/pretrain_gpt.py builds megatron-core's GPTModel only; "
                           "run Megatron-LM's pretrain_gpt.py through `python -m adapter.run` for the legacy one")
    print_rank_0("building GPT model ...")
    if config is None:
        config = (core_transformer_config_from_yaml(args, "language_model") if args.yaml_cfg is not None
                  else core_transformer_config_from_args(args))
    use_te = args.transformer_impl == "transformer_engine"
    layer_spec = _decoder_spec(args, config, use_te, vp_stage)
    return GPTModel(
        config=config, transformer_layer_spec=layer_spec, vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings, pre_process=pre_process, post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy, parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base, rope_scaling=args.use_rope_scaling,
        mtp_block_spec=_mtp_block_spec(args, config, layer_spec, use_te, vp_stage), vp_stage=vp_stage,
        pg_collection=pg_collection)


def _decoder_spec(args, config, use_te: bool, vp_stage):
    """The decoder's layer spec (or block spec) the flags ask for, in the order Megatron-LM's builder asks."""
    if args.spec is not None:
        return import_module(args.spec)
    if args.experimental_attention_variant is not None:
        return get_transformer_block_with_experimental_attention_variant_spec(config=config, vp_stage=vp_stage)
    if args.num_experts:
        return specs.get_gpt_decoder_block_spec(config, use_transformer_engine=use_te,
                                                normalization=args.normalization, qk_l2_norm=args.qk_l2_norm,
                                                vp_stage=vp_stage)
    if args.heterogeneous_layers_config_path is not None:
        return get_gpt_heterogeneous_layer_spec(config, use_te)
    return _layer_spec(config, use_te)


def _layer_spec(config, use_te: bool):
    """One transformer layer's spec for ``--transformer-impl``: Transformer Engine's, inference's or local."""
    if config.transformer_impl == "inference_optimized" and not use_te:
        return specs.get_gpt_layer_with_inference_spec(config.qk_layernorm, config.multi_latent_attention,
                                                       qk_l2_norm=config.qk_l2_norm)
    build, keywords = ((specs.get_gpt_layer_with_transformer_engine_spec, _TE_KEYWORDS) if use_te
                       else (specs.get_gpt_layer_local_spec, _LOCAL_KEYWORDS))
    taken = inspect.signature(build).parameters
    return build(config.num_moe_experts, config.moe_grouped_gemm, config.qk_layernorm, config.multi_latent_attention,
                 **{name: getattr(config, name) for name in keywords if name in taken and hasattr(config, name)})


def _mtp_block_spec(args, config, layer_spec, use_te: bool, vp_stage):
    """The multi-token-prediction block under ``--mtp-num-layers``: each MTP layer is the last decoder layer."""
    if args.mtp_num_layers is None:
        return None
    if len(getattr(layer_spec, "layer_specs", (None,))) == 0:  # an MoE block spec with no layer on this stage
        last_layer = _layer_spec(config, use_te)
    else:
        last_layer = specs.get_gpt_decoder_layer_specs(config, use_transformer_engine=use_te,
                                                       normalization=args.normalization,
                                                       qk_l2_norm=args.qk_l2_norm, vp_stage=vp_stage)[-1]
    return specs.get_gpt_mtp_block_spec(config, last_layer, use_transformer_engine=use_te, vp_stage=vp_stage)

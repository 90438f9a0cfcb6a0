"""Hybrid models (Qwen3.5, Qwen3-Next) as megatron-core's ``HybridModel``, built from local modules.

megatron's hybrid stack takes a layer pattern, one symbol per layer of its own: ``G`` a Gated DeltaNet layer,
``*`` an attention layer, ``-`` an MLP layer, ``E`` a MoE layer. A Hugging Face Qwen3.5 layer (a token mixer,
then an MLP or MoE block, each with its norm and residual) is two of them: ``G-`` or ``*-`` (``GE``, ``*E``),
so megatron's ``num_layers`` is twice the model's. megatron's own hybrid specs are Transformer Engine's; this
one takes the attention, MLP and MoE modules megatron's local GPT spec gives (the kernel provider's norm and
core attention, through the same spec provider as the GPT models), and Gated DeltaNet's projections from the
same local linear layers, with the provider's norm after its gated delta rule.
"""

from __future__ import annotations

from packaging.version import Version

from adapter.registry import installed_megatron_core_version

from .config import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig, ModelConfigError

HYBRID_SINCE = "0.18"
MIXER_SYMBOLS = {LINEAR_ATTENTION: "G", FULL_ATTENTION: "*"}


def check_release() -> None:
    """One line naming the release a hybrid model needs, where the installed megatron-core lacks it."""
    installed = installed_megatron_core_version()
    if Version(installed) < Version(HYBRID_SINCE):
        raise ModelConfigError(f"a hybrid model (Gated DeltaNet layers) is built by megatron-core's HybridModel, which "
                               f"megatron-core {installed} lacks: install megatron-core>={HYBRID_SINCE} (Python 3.12)")


def layer_pattern(model: ModelConfig) -> str:
    """megatron's hybrid layer pattern of ``model``: per layer, its mixer's symbol, then ``-`` or ``E``."""
    return "".join(MIXER_SYMBOLS[mixer] + ("E" if moe else "-")
                   for mixer, moe in zip(model.mixers(), model.moe_layer_pattern()))


def hybrid_stack_spec(model: ModelConfig):
    """The ``HybridStack`` spec of ``model`` from local modules (module docstring)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import (
        MoETransformerLayer,
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    dense = get_gpt_layer_local_spec(normalization=model.normalization, qk_layernorm=model.qk_layernorm).submodules
    norm = dense.input_layernorm

    def layer(module, **submodules):
        return ModuleSpec(module=module, submodules=TransformerLayerSubmodules(**submodules))

    gated_delta_net = ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
        in_proj=ColumnParallelLinear, out_norm=norm, out_proj=RowParallelLinear))
    submodules = HybridStackSubmodules(
        gdn_layer=layer(TransformerLayer, input_layernorm=norm, self_attention=gated_delta_net,
                        self_attn_bda=dense.self_attn_bda),
        attention_layer=layer(TransformerLayer, input_layernorm=norm, self_attention=dense.self_attention,
                              self_attn_bda=dense.self_attn_bda),
        mlp_layer=layer(MLPLayer, pre_mlp_layernorm=dense.pre_mlp_layernorm, mlp=dense.mlp, mlp_bda=dense.mlp_bda))
    if model.num_experts is not None:
        moe = get_gpt_layer_local_spec(num_experts=model.num_experts, moe_grouped_gemm=True,
                                       normalization=model.normalization, qk_layernorm=model.qk_layernorm).submodules
        submodules.moe_layer = layer(MoETransformerLayer, pre_mlp_layernorm=moe.pre_mlp_layernorm, mlp=moe.mlp,
                                     mlp_bda=moe.mlp_bda)
    return ModuleSpec(module=HybridStack, submodules=submodules)


def build_hybrid_model(model: ModelConfig, config, vp_stage: int | None, pre_process: bool, post_process: bool):
    """The HybridModel chunk of this pipeline rank (and virtual stage) for a model with ``layer_types``."""
    check_release()
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    return HybridModel(config=config, hybrid_stack_spec=hybrid_stack_spec(model), vocab_size=model.vocab_size,
                       max_sequence_length=model.max_position_embeddings, hybrid_layer_pattern=layer_pattern(model),
                       pre_process=pre_process, post_process=post_process,
                       share_embeddings_and_output_weights=model.tie_embeddings, position_embedding_type="rope",
                       rotary_percent=model.rotary_percent, rotary_base=model.rotary_base, vp_stage=vp_stage)

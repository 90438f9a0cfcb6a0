"""GPT built as a megatron-core GPTModel from a named flavor plus overrides.

Flavors are plain data (torchtitan style). ``tiny`` is the test and laptop size: RMSNorm, SwiGLU, grouped
query attention, rotary embeddings, no linear biases, untied embeddings.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig


@dataclasses.dataclass(frozen=True)
class GPTFlavor:
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    vocab_size: int
    seq_length: int
    rotary_base: int = 10000
    norm_epsilon: float = 1e-5
    add_qkv_bias: bool = False
    tie_embeddings: bool = False


_TINY = GPTFlavor(num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                  num_query_groups=2, vocab_size=256, seq_length=32)

FLAVORS = {
    "tiny": _TINY,
    # input embedding and output layer share one weight, as in small Qwen2.5 models
    "tiny-tied": dataclasses.replace(_TINY, tie_embeddings=True),
}


def transformer_config(flavor: GPTFlavor, **overrides) -> TransformerConfig:
    """A TransformerConfig for ``flavor`` on the model-parallel layout already initialised."""
    settings = dict(
        num_layers=flavor.num_layers,
        hidden_size=flavor.hidden_size,
        ffn_hidden_size=flavor.ffn_hidden_size,
        num_attention_heads=flavor.num_attention_heads,
        num_query_groups=flavor.num_query_groups,
        normalization="RMSNorm",
        layernorm_epsilon=flavor.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=flavor.add_qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.02,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        virtual_pipeline_model_parallel_size=(
            parallel_state.get_virtual_pipeline_model_parallel_world_size()),
        pipeline_dtype=torch.float32,
        # Same full weights on every layout: megatron initialises the master weight on CPU and splits it.
        use_cpu_initialization=True,
    )
    settings.update(overrides)
    return TransformerConfig(**settings)


def build_gpt(flavor: GPTFlavor, config: TransformerConfig, vp_stage: int | None = None) -> GPTModel:
    """The GPTModel chunk for this pipeline rank (and virtual stage)."""
    pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=flavor.vocab_size,
        max_sequence_length=flavor.seq_length,
        pre_process=pre,
        post_process=post,
        share_embeddings_and_output_weights=flavor.tie_embeddings,
        position_embedding_type="rope",
        rotary_base=flavor.rotary_base,
        vp_stage=vp_stage,
    )

"""``models.megatron_lm_args``: a named model's Megatron-LM flags, read by megatron.training's own parser and its
own ``core_transformer_config_from_args`` (the wheel's, 0.17+), give the TransformerConfig the model provider
builds, field for field, for every named model they can describe; the others are refused in one line."""

from __future__ import annotations

import sys

import pytest
from packaging.version import Version

import adapter  # noqa: F401 - before megatron
import models
from adapter.registry import installed_megatron_core_version
from models.config import ModelConfigError
from models.megatron_lm_args import flags

# TransformerConfig fields that define the weights and the numerics (the provider's training defaults, parallel
# sizes and dtypes are the command line's business)
ARCHITECTURE = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
    "normalization", "layernorm_epsilon", "gated_linear_unit", "activation_func", "add_bias_linear", "add_qkv_bias",
    "qk_layernorm", "attention_output_gate", "layernorm_zero_centered_gamma", "num_moe_experts",
    "moe_ffn_hidden_size", "moe_router_topk", "moe_layer_freq", "moe_shared_expert_intermediate_size",
    "moe_shared_expert_gate", "moe_router_score_function", "moe_router_pre_softmax", "moe_router_topk_scaling_factor",
    "moe_router_enable_expert_bias", "moe_aux_loss_coeff", "moe_router_num_groups", "moe_router_group_topk",
    "mtp_num_layers", "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
    "v_head_dim", "rotary_scaling_factor", "mscale", "mscale_all_dim", "original_max_position_embeddings",
    "beta_fast", "beta_slow")
# what megatron.training's GPT builder reads from the arguments beside the TransformerConfig, and our field for it
MODEL_ARGUMENTS = {"position_embedding_type": "position_embedding", "rotary_base": "rotary_base",
                   "rotary_percent": "rotary_percent", "max_position_embeddings": "max_position_embeddings"}
# MLA's YaRN fields have Megatron-LM flags from megatron-core 0.19 (patches/latent_attention.py sets them)
MLA_YARN = Version(installed_megatron_core_version()) >= Version("0.19")
REFUSED = {} if MLA_YARN else {"deepseek-v3-tiny": "original_max_position_embeddings=64", "kimi-k2": "beta_fast=1.0"}
HYBRID = [name for name in models.names() if models.get(name).layer_types is not None]
DESCRIBED = [name for name in models.names() if name not in REFUSED and name not in HYBRID]


@pytest.fixture(autouse=True)
def _connections_restored(monkeypatch):
    """megatron.training's validate_args, run here in the test's own process, sets CUDA_DEVICE_MAX_CONNECTIONS=1
    off CUDA (patches/megatron_lm.py): restored after each test, or later tests in this process and the ranks
    they start inherit it (Megatron-FSDP refuses it; megatron's sequence-parallel hint then goes unsaid)."""
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")


@pytest.fixture(scope="module")
def one_rank():
    from models.torch_dist_io import single_process_groups

    with single_process_groups():
        yield


def _megatron_lm_arguments(words: list[str], monkeypatch, tokenizer=("--tokenizer-type", "NullTokenizer",
                                                                    "--vocab-size", "128"), world: int = 1):
    """Megatron-LM's parsed and validated arguments for ``words`` plus what a run needs besides a model."""
    from megatron.training.arguments import parse_args, validate_args

    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *words, "--micro-batch-size", "1", *tokenizer,
                                      "--lr", "1e-4", "--train-iters", "1", "--eval-interval", "1",
                                      "--transformer-impl", "local"])
    for name, value in (("WORLD_SIZE", str(world)), ("RANK", "0"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(name, value)
    args = parse_args()
    validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})  # Megatron-LM's pretrain_gpt.py's default
    return args


@pytest.mark.parametrize("name", DESCRIBED)
def test_megatron_lm_builds_the_named_models_transformer_config_from_its_flags(name, one_rank, monkeypatch):
    from megatron.training.arguments import core_transformer_config_from_args

    from models.provider import transformer_config

    model = models.get(name)
    args = _megatron_lm_arguments(flags(model), monkeypatch)
    theirs, ours = core_transformer_config_from_args(args), transformer_config(model)
    differing = {field: (getattr(theirs, field, None), getattr(ours, field, None)) for field in ARCHITECTURE
                 if getattr(theirs, field, None) != getattr(ours, field, None)}
    assert not differing, f"{name}: Megatron-LM's / ours: {differing}"
    assert {arg: getattr(args, arg) for arg in MODEL_ARGUMENTS} == {
        arg: getattr(model, field) for arg, field in MODEL_ARGUMENTS.items()}
    assert args.untie_embeddings_and_output_weights is not model.tie_embeddings


@pytest.mark.parametrize("name", [*REFUSED, *HYBRID[:1]])
def test_a_model_megatron_lm_flags_cannot_describe_is_refused_naming_why(name):
    with pytest.raises(ModelConfigError) as refused:
        flags(models.get(name))
    assert REFUSED.get(name, "hybrid model") in str(refused.value)
    assert "scripts/pretrain_gpt.py --model NAME" in str(refused.value)


def test_the_command_prints_the_flags_on_one_line_and_refuses_in_one(capsys):
    from models.megatron_lm_args import main

    assert main(["qwen3-tiny"]) == 0
    assert capsys.readouterr().out.splitlines() == [" ".join(flags(models.get("qwen3-tiny")))]
    assert main([HYBRID[0]]) == 2
    refused = capsys.readouterr().err.splitlines()
    assert len(refused) == 1 and refused[0].startswith("error: a hybrid model"), refused


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_a_named_models_embedding_has_its_own_rows_at_any_tp_and_a_null_tokenizer_over_them(tp, monkeypatch):
    """Without tokenizer flags, megatron builds NullTokenizer over the named model's rows (its end-of-document id
    the last of them), and the embedding has the model's rows, which megatron's padding of 151936 to a
    multiple of 128 x TP would exceed at TP > 1: what a checkpoint converted from Hugging Face holds. A
    tokenizer of the command line's own keeps the rows."""
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

    model = models.get("qwen3-8b")
    words = [*flags(model), "--tensor-model-parallel-size", str(tp)]
    args = _megatron_lm_arguments(words, monkeypatch, tokenizer=(), world=tp)
    tokenizer = build_tokenizer(args)
    assert (args.tokenizer_type, args.padded_vocab_size) == ("NullTokenizer", model.vocab_size) == (
        "NullTokenizer", 151936)
    assert (tokenizer.vocab_size, tokenizer.eod) == (model.vocab_size, model.vocab_size - 1)
    own = _megatron_lm_arguments(words, monkeypatch, world=tp)
    assert (build_tokenizer(own).vocab_size, own.padded_vocab_size) == (128, model.vocab_size)


@pytest.mark.parametrize("name", HYBRID)
def test_the_flows_flags_of_a_hybrid_model_give_megatron_its_transformer_config(name, one_rank, monkeypatch):
    """scripts/pretrain_gpt.py's flags of a hybrid model (flow.model_flags): megatron.training's own
    TransformerConfig of them is the provider's (megatron's layers two per model layer, the Gated DeltaNet
    sizes), megatron counts the run as hybrid, and flow.hybrid reads the named model back from them."""
    from megatron.training.arguments import core_transformer_config_from_args

    from flow import hybrid
    from flow.model_flags import flow_flags
    from models.config import HYBRID_FIELDS
    from models.provider import transformer_config

    model = models.get(name)
    args = _megatron_lm_arguments(flow_flags(model), monkeypatch, tokenizer=())
    theirs, ours = core_transformer_config_from_args(args), transformer_config(model)
    differing = {field: (getattr(theirs, field, None), getattr(ours, field, None))
                 for field in (*ARCHITECTURE, *HYBRID_FIELDS)
                 if getattr(theirs, field, None) != getattr(ours, field, None)}
    assert not differing, f"{name}: megatron's / ours: {differing}"
    assert theirs.is_hybrid_model and args.num_layers == 2 * model.num_layers
    assert hybrid.pretrain_inputs(args, name)[0].model is None  # pretrain takes flow.hybrid's model_provider
    assert hybrid._as_given(args, name) == model

"""Named model configs: each Qwen2.5 equals its published config.json, and every named model, built by
megatron-core on the meta device, has the parameter count of the Hugging Face model of the same config
(Mixtral or Qwen2-MoE for the MoE ones; more MoE variants in tests/test_moe_flow.py)."""

from __future__ import annotations

import argparse

import pytest
import torch

import models
from models.config import ModelConfigError
from models.hf import config_from_hf, config_to_hf

# The fields of huggingface.co/Qwen/Qwen2.5-<size>/blob/main/config.json (base models) that define the
# network: (layers, hidden, intermediate, heads, kv heads, vocab, max positions, rms eps, tied)
PUBLISHED_QWEN25 = {
    "0.5b": (24, 896, 4864, 14, 2, 151936, 32768, 1e-6, True),
    "1.5b": (28, 1536, 8960, 12, 2, 151936, 131072, 1e-6, True),
    "3b": (36, 2048, 11008, 16, 2, 151936, 32768, 1e-6, True),
    "7b": (28, 3584, 18944, 28, 4, 152064, 131072, 1e-6, False),
    "14b": (48, 5120, 13824, 40, 8, 152064, 131072, 1e-5, False),
    "32b": (64, 5120, 27648, 40, 8, 152064, 131072, 1e-5, False),
    "72b": (80, 8192, 29568, 64, 8, 152064, 131072, 1e-5, False),
}


def _published_config_json(size: str) -> dict:
    layers, hidden, ffn, heads, kv, vocab, positions, eps, tied = PUBLISHED_QWEN25[size]
    return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
            "num_hidden_layers": layers, "hidden_size": hidden, "intermediate_size": ffn,
            "num_attention_heads": heads, "num_key_value_heads": kv, "vocab_size": vocab,
            "max_position_embeddings": positions, "rope_theta": 1000000.0, "rms_norm_eps": eps,
            "tie_word_embeddings": tied, "use_sliding_window": False, "sliding_window": positions,
            "max_window_layers": layers, "torch_dtype": "bfloat16"}


@pytest.mark.parametrize("size", list(PUBLISHED_QWEN25))
def test_qwen25_named_config_equals_the_published_config_json(size):
    assert models.get(f"qwen2.5-{size}") == config_from_hf(_published_config_json(size))


# The fields of each Qwen3 config.json that define the network (module docstring of models/qwen3.py: the base
# model's where one is published): (layers, hidden, intermediate, heads, kv heads, max positions, tied), and
# for the MoE ones (experts, experts per token, moe_intermediate_size). Every one: head_dim 128, vocab 151936,
# rope_theta 1e6, rms_norm_eps 1e-6, attention_bias false; MoE: norm_topk_prob true, decoder_sparse_step 1,
# mlp_only_layers [], router_aux_loss_coef 0.001.
PUBLISHED_QWEN3 = {
    "0.6b": ((28, 1024, 3072, 16, 8, 32768, True), None),
    "1.7b": ((28, 2048, 6144, 16, 8, 32768, True), None),
    "4b": ((36, 2560, 9728, 32, 8, 32768, True), None),
    "8b": ((36, 4096, 12288, 32, 8, 32768, False), None),
    "14b": ((40, 5120, 17408, 40, 8, 32768, False), None),
    "32b": ((64, 5120, 25600, 64, 8, 40960, False), None),
    "30b-a3b": ((48, 2048, 6144, 32, 4, 32768, False), (128, 8, 768)),
    "235b-a22b": ((94, 4096, 12288, 64, 4, 40960, False), (128, 8, 1536)),
}


def _published_qwen3_config_json(size: str) -> dict:
    (layers, hidden, ffn, heads, kv, positions, tied), experts = PUBLISHED_QWEN3[size]
    config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
              "attention_dropout": 0.0, "head_dim": 128, "hidden_act": "silu", "hidden_size": hidden,
              "intermediate_size": ffn, "max_position_embeddings": positions, "max_window_layers": layers,
              "num_attention_heads": heads, "num_hidden_layers": layers, "num_key_value_heads": kv,
              "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
              "tie_word_embeddings": tied, "torch_dtype": "bfloat16", "use_sliding_window": False,
              "vocab_size": 151936}
    if experts:
        config.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", decoder_sparse_step=1,
                      mlp_only_layers=[], norm_topk_prob=True, output_router_logits=False, router_aux_loss_coef=0.001,
                      num_experts=experts[0], num_experts_per_tok=experts[1], moe_intermediate_size=experts[2])
    return config


@pytest.mark.parametrize("size", list(PUBLISHED_QWEN3))
def test_qwen3_named_config_equals_the_published_config_json(size):
    assert models.get(f"qwen3-{size}") == config_from_hf(_published_qwen3_config_json(size))


def test_qwen3_sizes_are_the_published_ones():
    """The counts Qwen publishes: 0.6B exactly (596,049,920 with tied embeddings), and the model cards' 30.5B
    (3.3B active) and 235B (22B active), active being all but the 120 experts of 128 a token skips."""
    assert models.get("qwen3-0.6b").num_parameters() == 596_049_920
    for name, total, active, rounding in (("qwen3-30b-a3b", 30.5, 3.3, 0.1), ("qwen3-235b-a22b", 235, 22, 0.5)):
        model = models.get(name)
        moe = model.moe_parameters()
        routed = model.num_experts * model.mlp_parameters(model.expert_ffn_hidden_size)
        per_layer_active = moe - routed + routed * model.moe_router_topk // model.num_experts
        assert model.num_parameters() / 1e9 == pytest.approx(total, abs=rounding)
        assert (model.num_parameters() - model.num_layers * (moe - per_layer_active)) / 1e9 == pytest.approx(
            active, abs=rounding)


def test_qwen25_72b_is_the_recipe_model():
    m = models.get("qwen2.5-72b")
    assert (m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads, m.num_query_groups) == (
        80, 8192, 29568, 64, 8)
    assert (m.vocab_size, m.rotary_base, m.norm_epsilon) == (152064, 1e6, 1e-5)
    assert (m.normalization, m.activation, m.position_embedding) == ("RMSNorm", "swiglu", "rope")
    assert m.add_qkv_bias and not m.add_bias_linear and not m.tie_embeddings



@pytest.mark.parametrize("name, total, active, rounding", [
    ("qwen3.5-9b", 9, None, 0.1), ("qwen3.5-35b-a3b", 35, 3, 0.5), ("qwen3.5-397b-a17b", 397, 17, 0.7),
    ("qwen3-next-80b-a3b", 80, 3, 0.9)])
def test_hybrid_sizes_are_what_their_names_publish(name, total, active, rounding):
    """The hybrid flavours' numbers (from transformers' documented defaults and the flagship's model card,
    models/qwen35.py) count the parameters their names publish: total and, for MoE, active."""
    model = models.get(name)
    assert model.num_parameters() / 1e9 == pytest.approx(total, abs=rounding)
    if active is not None:
        skipped = model.num_layers * (model.num_experts - model.moe_router_topk) * model.mlp_parameters(
            model.expert_ffn_hidden_size)
        assert (model.num_parameters() - skipped) / 1e9 == pytest.approx(active, abs=rounding)

@pytest.fixture(scope="module")
def one_rank():
    from models.torch_dist_io import single_process_groups

    import adapter  # noqa: F401

    with single_process_groups():
        yield


def _megatron_parameters(model) -> int:
    from models.provider import build_model, transformer_config

    with torch.device("meta"):
        gpt = build_model(model, transformer_config(model, perform_initialization=False))
    return sum(p.numel() for p in gpt.parameters())


def _hf_parameters(model) -> int:
    transformers = pytest.importorskip("transformers")
    if model.layer_types is not None:  # Qwen3.5, Qwen3-Next: the config tests/test_hybrid_models.py builds
        from tests.test_hybrid_models import _hf_config

        with torch.device("meta"):
            return sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(_hf_config(model)).parameters())
    if model.multi_latent_attention:  # DeepSeek-V3, Kimi-K2
        return _hf_deepseek_v3_parameters(model)
    if model.num_experts is not None and not model.qk_layernorm:
        from tests.test_moe_flow import _hf_moe

        shared = model.moe_shared_expert_intermediate_size is not None
        hf = _hf_moe(model, "Qwen2MoeForCausalLM" if shared else "MixtralForCausalLM")
        return sum(p.numel() for p in hf.parameters())
    if model.position_embedding == "learned_absolute":  # the GPT-3 shapes: GPT-2's architecture
        config = transformers.GPT2Config(
            vocab_size=model.vocab_size, n_positions=model.max_position_embeddings, n_embd=model.hidden_size,
            n_layer=model.num_layers, n_head=model.num_attention_heads, n_inner=model.ffn_hidden_size,
            tie_word_embeddings=model.tie_embeddings)
        cls = transformers.GPT2LMHeadModel
    else:
        hf = config_to_hf(model)  # Qwen2, Llama, Qwen3 or Qwen3-MoE
        cls = getattr(transformers, hf["architectures"][0])
        config = cls.config_class(**{k: v for k, v in hf.items() if k != "architectures"})
    with torch.device("meta"):
        return sum(p.numel() for p in cls(config).parameters())


def _hf_deepseek_v3_parameters(model) -> int:
    """Hugging Face's DeepseekV3ForCausalLM of ``model``'s sizes, which builds no MTP layer."""
    import transformers

    config = transformers.DeepseekV3Config(
        vocab_size=model.vocab_size, hidden_size=model.hidden_size, intermediate_size=model.ffn_hidden_size,
        moe_intermediate_size=model.moe_ffn_hidden_size, num_hidden_layers=model.num_layers,
        num_attention_heads=model.num_attention_heads, num_key_value_heads=model.num_attention_heads,
        n_shared_experts=model.moe_shared_expert_intermediate_size // model.moe_ffn_hidden_size,
        n_routed_experts=model.num_experts, kv_lora_rank=model.kv_lora_rank, q_lora_rank=model.q_lora_rank,
        qk_rope_head_dim=model.qk_pos_emb_head_dim, v_head_dim=model.v_head_dim, qk_nope_head_dim=model.qk_head_dim,
        n_group=model.moe_router_num_groups or 1, topk_group=model.moe_router_group_topk or 1,
        num_experts_per_tok=model.moe_router_topk, first_k_dense_replace=model.moe_layer_pattern().index(1),
        tie_word_embeddings=model.tie_embeddings)
    with torch.device("meta"):
        return sum(p.numel() for p in transformers.DeepseekV3ForCausalLM(config).parameters())


@pytest.mark.parametrize("name", models.names())
def test_megatron_parameter_count_equals_hugging_face(one_rank, name):
    model = models.get(name)
    if model.layer_types is not None:
        from tests.test_hybrid_models import NO_HYBRID, NO_QWEN35

        if NO_HYBRID or NO_QWEN35:
            pytest.skip(f"{name}: needs megatron-core's HybridModel (0.18+) and transformers' Qwen3.5 (5.23+)")
    count = _megatron_parameters(model)
    mtp = (model.mtp_num_layers or 0) * model.mtp_layer_parameters()  # megatron's MTP layers, which HF does not build
    assert count == _hf_parameters(model) + mtp == model.num_parameters()


def test_published_sizes_are_what_the_names_say():
    billions = {name: models.get(name).num_parameters() / 1e9 for name in models.names()}
    assert billions["qwen2.5-72b"] == pytest.approx(72.7, abs=0.05)
    assert billions["qwen2.5-7b"] == pytest.approx(7.62, abs=0.01)
    assert billions["qwen2.5-0.5b"] == pytest.approx(0.494, abs=0.001)
    assert billions["gpt-125m"] == pytest.approx(0.125, abs=0.005)
    assert billions["gpt-1.3b"] == pytest.approx(1.3, abs=0.05)


def test_unknown_model_names_the_known_ones():
    with pytest.raises(ModelConfigError, match="unknown model 'qwen4-8b': known models are gpt-tiny, "):
        models.get("qwen4-8b")


def test_overrides_apply_and_unknown_settings_are_refused():
    assert models.get("qwen2.5-tiny", num_layers=8).num_layers == 8
    with pytest.raises(ModelConfigError, match="unknown model setting.*num_layer\\b"):
        models.get("qwen2.5-tiny", num_layer=8)


@pytest.mark.parametrize("tp, pp, vpp, message", [
    (3, 1, None, "tensor parallel size 3 does not divide num_attention_heads=64"),
    (16, 1, None, "tensor parallel size 16 does not divide num_query_groups=8"),
    (1, 3, None, r"80 layers cannot be split evenly over pipeline \(3\) x virtual pipeline \(1\) = 3 stages"),
    (1, 4, 3, r"80 layers cannot be split evenly over pipeline \(4\) x virtual pipeline \(3\) = 12 stages"),
])
def test_layouts_megatron_would_fail_on_are_refused_by_name(tp, pp, vpp, message):
    with pytest.raises(ModelConfigError, match=message):
        models.get("qwen2.5-72b").check_layout(tp, pp, vpp)
    models.get("qwen2.5-72b").check_layout(8, 4, 5)  # the recipe's layout


def test_config_from_megatron_style_args():
    from models.provider import config_from_args

    args = argparse.Namespace(model="qwen2.5-72b", seq_length=8192, num_layers=None, hidden_size=None)
    assert config_from_args(args) == models.get("qwen2.5-72b", seq_length=8192)
    # Megatron-LM's switches default to False: over a named model that is "not given"
    megatron_defaults = argparse.Namespace(model="qwen2.5-72b", swiglu=False, disable_bias_linear=False,
                                           add_qkv_bias=False, group_query_attention=False, num_query_groups=1,
                                           untie_embeddings_and_output_weights=False)
    assert config_from_args(megatron_defaults) == models.get("qwen2.5-72b")
    args = argparse.Namespace(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                              group_query_attention=True, num_query_groups=2, padded_vocab_size=256,
                              seq_length=32, max_position_embeddings=64, swiglu=True,
                              disable_bias_linear=True, add_qkv_bias=True, normalization="RMSNorm",
                              untie_embeddings_and_output_weights=True)
    built = config_from_args(args)
    assert (built.num_query_groups, built.vocab_size, built.activation, built.tie_embeddings) == (
        2, 256, "swiglu", False)
    with pytest.raises(ModelConfigError, match="pass --model NAME or every architecture argument"):
        config_from_args(argparse.Namespace(num_layers=2))


@pytest.mark.parametrize("settings, message", [
    (dict(num_experts=0), "num_experts=0: must be a positive integer"),
    (dict(num_experts=8, moe_router_topk=9), "moe_router_topk=9 exceeds num_experts=8"),
    (dict(num_experts=8, moe_router_topk=1), "moe_router_topk=1 with the softmax after the top-k"),
    (dict(num_experts=8, moe_layer_freq=(1, 0)), r"moe_layer_freq=\[1, 0\]: a pattern needs one 0 \(dense\) or 1"),
    (dict(num_experts=8, moe_layer_freq=(0, 0, 0, 0)), "with at least one 1"),
    (dict(num_experts=8, moe_layer_freq=0), "moe_layer_freq=0: must be a positive integer"),
    (dict(num_experts=8, moe_router_score_function="relu"), "moe_router_score_function='relu': use one of"),
    (dict(num_experts=8, moe_router_enable_expert_bias=True), "needs moe_router_score_function='sigmoid'"),
    (dict(num_experts=8, moe_shared_expert_gate=True), "moe_shared_expert_gate=True without a shared expert"),
    (dict(num_experts=8, moe_shared_expert_intermediate_size=64, add_bias_linear=True),
     "a shared expert with add_bias_linear=True"),
    (dict(moe_ffn_hidden_size=64, moe_router_topk=4), "moe_ffn_hidden_size=64, moe_router_topk=4 on a dense model"),
])
def test_moe_settings_megatron_would_refuse_are_refused_by_name(settings, message):
    with pytest.raises(ModelConfigError, match=message):
        models.get("gpt-tiny", **settings)


def test_moe_config_spellings():
    moe = models.get("gpt-tiny", num_experts=4, moe_layer_freq=[0, 1, 0, 1], moe_shared_expert_intermediate_size=0)
    assert moe == models.get("gpt-tiny", num_experts=4, moe_layer_freq=(0, 1, 0, 1))
    assert moe.expert_ffn_hidden_size == moe.ffn_hidden_size and moe.moe_shared_expert_intermediate_size is None
    assert models.get("gpt-tiny", num_experts=4, moe_layer_freq=3).moe_layer_pattern() == (1, 0, 0, 1)


@pytest.mark.parametrize("layout, message", [
    (dict(ep=3), "expert parallel size 3 does not divide num_experts=8"),
    (dict(tp=2, etp=3), "expert tensor parallel size 3 does not divide expert_ffn_hidden_size=64"),
    (dict(tp=3), "tensor parallel size 3 does not divide num_attention_heads=4"),
])
def test_moe_layouts_megatron_would_fail_on_are_refused_by_name(layout, message):
    with pytest.raises(ModelConfigError, match=message):
        models.get("gpt-tiny-moe").check_layout(**layout)
    with pytest.raises(ModelConfigError, match="expert parallel size 2 for a dense model"):
        models.get("gpt-tiny").check_layout(ep=2)
    with pytest.raises(ModelConfigError, match="expert tensor parallel size 2 with add_bias_linear=True"):
        models.get("gpt-tiny-moe", add_bias_linear=True).check_layout(tp=2)
    models.get("gpt-tiny-moe").check_layout(tp=2, ep=8, etp=1)
    # all layers MoE: the unused dense FFN size need not divide by TP
    models.get("gpt-tiny-moe", ffn_hidden_size=100).check_layout(tp=2)


def test_moe_config_from_megatron_style_args():
    from models.provider import config_from_args

    off = dict(moe_shared_expert_gate=False, moe_router_pre_softmax=False, moe_router_enable_expert_bias=False,
               qk_layernorm=False)
    # over a named MoE model, switches that are off (Megatron-LM's defaults) change nothing
    assert config_from_args(argparse.Namespace(model="gpt-tiny-moe-shared", **off)) == models.get("gpt-tiny-moe-shared")
    args = argparse.Namespace(model="gpt-tiny", num_experts=4, moe_ffn_hidden_size=32, moe_router_topk=1,
                              moe_layer_freq=[1, 0, 1, 0], moe_shared_expert_intermediate_size=64,
                              moe_router_score_function="sigmoid", moe_router_topk_scaling_factor=2.0,
                              **{**off, "moe_shared_expert_gate": True, "moe_router_enable_expert_bias": True,
                                 "qk_layernorm": True})
    assert config_from_args(args) == models.get(
        "gpt-tiny", num_experts=4, moe_ffn_hidden_size=32, moe_router_topk=1, moe_layer_freq=(1, 0, 1, 0),
        moe_shared_expert_intermediate_size=64, moe_shared_expert_gate=True, moe_router_score_function="sigmoid",
        moe_router_topk_scaling_factor=2.0, moe_router_enable_expert_bias=True, qk_layernorm=True)


def test_hugging_face_conversion_refuses_what_no_architecture_holds():
    """Experts convert as Qwen3-MoE only (QK-norm, no QKV bias, routed experts, a softmax router): anything
    else is named, not written out without its experts or with a router transformers would run otherwise."""
    from models import hf

    for architecture in ("Qwen2ForCausalLM", "LlamaForCausalLM", "Qwen3ForCausalLM"):
        with pytest.raises(hf.UnsupportedCheckpoint, match="num_experts=8"):
            hf.ARCHITECTURES[architecture].layers(models.get("gpt-tiny-moe"))
    with pytest.raises(hf.UnsupportedCheckpoint, match="Qwen3-MoE\\) needs QK-norm and no QKV bias"):
        hf.architecture_for(models.get("gpt-tiny-moe"))
    with pytest.raises(hf.UnsupportedCheckpoint, match="moe_shared_expert_intermediate_size=128.*routed experts"):
        config_to_hf(models.get("gpt-tiny-moe-shared", qk_layernorm=True))
    with pytest.raises(hf.UnsupportedCheckpoint, match="does not fit Qwen2ForCausalLM: it is a Qwen3ForCausalLM"):
        config_to_hf(models.get("qwen3-tiny"), "Qwen2ForCausalLM")

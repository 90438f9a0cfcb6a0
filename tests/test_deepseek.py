"""DeepSeek-V3 and Kimi-K2 as named models (models/deepseek.py), and Megatron-LM's multi-latent attention and MTP
flags in the one flow (scripts/pretrain_gpt.py on megatron.training).

The 671B and 1T configs are checked against their parameter counts computed here from the Hugging Face
config.json numbers alone (DeepSeek-V3: 671B total, 37B activated, and its 14B MTP module as Hugging Face
stores it); the flow's MLA and MTP flags against the TransformerConfig Megatron-LM's own argument handling makes
of the same command line; ``deepseek-v3-tiny`` trains through the flow on 2 gloo ranks at TP2, EP2 and PP2 (4 at
TP2 x PP2) with a falling loss, and with the npu provider against the torch_npu double on the torch provider's curve."""

from __future__ import annotations

import pytest
import torch
from packaging.version import Version

import models
from adapter.registry import installed_megatron_core_version
from tests.conftest import DOUBLES
from tests.distributed import run_ranks
from tests.flow_ranks import logged_losses, printed_losses, run_pretrain

NPU_DOUBLE = {"ADAPTER_BACKEND": "cpu", "ADAPTER_KERNELS": "npu", "PYTHONPATH": str(DOUBLES)}

pytestmark = pytest.mark.multiproc  # the ep2_curve fixture starts ranks (a fixture cannot carry marks)

# the published config.json numbers (deepseek-ai/DeepSeek-V3, moonshotai/Kimi-K2-Base)
DEEPSEEK_V3 = dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                   num_hidden_layers=61, num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512,
                   qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256, n_shared_experts=1,
                   num_experts_per_tok=8, first_k_dense_replace=3, num_nextn_predict_layers=1)
KIMI_K2 = {**DEEPSEEK_V3, "vocab_size": 163840, "num_attention_heads": 64, "n_routed_experts": 384,
           "first_k_dense_replace": 1, "num_nextn_predict_layers": 0}


def _published(hf: dict) -> dict[str, int]:
    """Parameter counts of a DeepSeek-V3-architecture config.json: the model without its MTP module (total and
    activated: the routed experts a token is not sent to left out), and the MTP module as Hugging Face stores it
    (its own embedding and head copies, two norms, the 2h -> h projection, a MoE layer, a norm)."""
    h, heads, q, kv = hf["hidden_size"], hf["num_attention_heads"], hf["q_lora_rank"], hf["kv_lora_rank"]
    nope, rope, v = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"], hf["v_head_dim"]
    attention = (h * q + q + q * heads * (nope + rope) + h * (kv + rope) + kv + kv * heads * (nope + v)
                 + heads * v * h)
    expert = 3 * h * hf["moe_intermediate_size"]
    dense = 2 * h + attention + 3 * h * hf["intermediate_size"]
    moe = 2 * h + attention + (hf["n_routed_experts"] + hf["n_shared_experts"]) * expert + hf["n_routed_experts"] * h
    sparse = hf["num_hidden_layers"] - hf["first_k_dense_replace"]
    total = 2 * hf["vocab_size"] * h + h + hf["first_k_dense_replace"] * dense + sparse * moe
    idle = (hf["n_routed_experts"] - hf["num_experts_per_tok"]) * expert
    mtp = 2 * hf["vocab_size"] * h + 3 * h + 2 * h * h + moe
    return {"total": total, "active": total - sparse * idle, "mtp": mtp * hf["num_nextn_predict_layers"]}


def _without_mtp(model) -> tuple[int, int]:
    """(total, activated) parameters of ``model`` less its MTP layers (megatron's, sharing the embedding)."""
    plain = model.replace(mtp_num_layers=None)
    return plain.num_parameters(), plain.num_active_parameters()


def test_deepseek_v3_has_its_published_671b_total_and_37b_activated_parameters():
    published = _published(DEEPSEEK_V3)
    assert _without_mtp(models.get("deepseek-v3")) == (published["total"], published["active"])
    assert published["total"] / 1e9 == pytest.approx(671, abs=0.5)
    # 37.5B with both the embedding and the output layer; DeepSeek's 37B leaves the embedding lookup out
    assert (published["active"] - DEEPSEEK_V3["vocab_size"] * DEEPSEEK_V3["hidden_size"]) / 1e9 == pytest.approx(
        37, abs=0.5)
    # DeepSeek's README: "685B ... 671B of the main model weights and 14B of the MTP module weights" (13.5B)
    assert published["mtp"] / 1e9 == pytest.approx(14, abs=0.6)
    model = models.get("deepseek-v3")
    shared = 2 * DEEPSEEK_V3["vocab_size"] * DEEPSEEK_V3["hidden_size"]  # megatron's MTP layer shares them
    assert model.num_parameters() - published["total"] == published["mtp"] - shared


def test_kimi_k2_has_its_published_1t_total_and_32b_activated_parameters():
    published = _published(KIMI_K2)
    assert _without_mtp(models.get("kimi-k2")) == (published["total"], published["active"])
    assert models.get("kimi-k2").mtp_num_layers is None
    assert published["total"] / 1e12 == pytest.approx(1.03, abs=0.01)
    assert (published["active"] - KIMI_K2["vocab_size"] * KIMI_K2["hidden_size"]) / 1e9 == pytest.approx(32, abs=0.5)


def test_the_named_configs_carry_the_published_routing_and_rope():
    v3, k2, tiny = models.get("deepseek-v3"), models.get("kimi-k2"), models.get("deepseek-v3-tiny")
    assert v3.moe_layer_pattern() == (0, 0, 0) + (1,) * 58 and k2.moe_layer_pattern() == (0,) + (1,) * 60
    assert (v3.moe_router_num_groups, v3.moe_router_group_topk, v3.moe_router_topk_scaling_factor) == (8, 4, 2.5)
    assert (k2.moe_router_num_groups, k2.moe_router_topk_scaling_factor, k2.rotary_base) == (None, 2.827, 50000.0)
    assert (v3.rotary_scaling_factor, v3.mscale, v3.mscale_all_dim, v3.beta_fast, v3.beta_slow) == (40, 1, 1, 32, 1)
    assert (k2.rotary_scaling_factor, k2.beta_fast, k2.beta_slow) == (32, 1, 1)
    assert not v3.tie_embeddings and v3.moe_router_score_function == "sigmoid" and v3.moe_router_enable_expert_bias
    assert tiny.moe_layer_pattern()[0] == 0 and tiny.q_lora_rank and tiny.mtp_num_layers == 1
    assert tiny.moe_router_num_groups > tiny.moe_router_group_topk and tiny.moe_shared_expert_intermediate_size


def test_mla_settings_megatron_would_refuse_are_refused_by_name():
    with pytest.raises(models.ModelConfigError, match="q_lora_rank=8 without multi_latent_attention"):
        models.get("gpt-tiny", q_lora_rank=8)
    with pytest.raises(models.ModelConfigError, match="MLA has no grouped-query attention"):
        models.get("deepseek-v3-tiny", num_query_groups=2)


# Megatron-LM's flags (tests/test_megatron_lm_deepseek.py's), without --model
MLA_FLAGS = ["--multi-latent-attention", "--q-lora-rank", "32", "--kv-lora-rank", "16", "--qk-head-dim", "16",
             "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16", "--rotary-scaling-factor", "40", "--mscale", "1.0",
             "--mscale-all-dim", "1.0", "--qk-layernorm", "--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.3"]
ARCHITECTURE = ["--num-layers", "4", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
                "--seq-length", "64", "--vocab-size", "256",
                "--max-position-embeddings", "64", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
                "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights"]
MEANING = ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
           "rope_type", "rotary_base", "rotary_scaling_factor", "mscale", "mscale_all_dim",
           "original_max_position_embeddings", "beta_fast", "beta_slow", "qk_layernorm", "num_query_groups",
           "mtp_num_layers", "mtp_loss_scaling_factor")


@pytest.fixture(scope="module")
def one_rank():
    from models.torch_dist_io import single_process_groups

    import adapter  # noqa: F401

    with single_process_groups():
        yield


def _megatron_lm_parser():
    """Megatron-LM's argument parser as its ``parse_args`` builds it, without parsing sys.argv."""
    import argparse

    from megatron.training.arguments import add_megatron_arguments

    return add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))


@pytest.mark.megatron_training
def test_mla_and_mtp_flags_mean_what_they_mean_in_megatron_lm(one_rank, monkeypatch):
    """The same command line through Megatron-LM's bare parser and core_transformer_config_from_args (shipped in
    megatron-core's wheel) and through the flow (megatron.training's parser with the adapter's patches, the GPT
    config it builds): the same MLATransformerConfig fields; the model the flow's config builds has megatron's MLA
    layers of those sizes and an MTP block of one layer."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention
    from megatron.training import global_vars

    from tests.test_flow_arguments import BASE, parse_as_the_flow

    argument_utils = pytest.importorskip("megatron.training.argument_utils")
    theirs_args = _megatron_lm_parser().parse_args([*ARCHITECTURE, *MLA_FLAGS, "--micro-batch-size", "1"])
    theirs_args.params_dtype, theirs_args.num_query_groups = torch.float32, None  # what its validate_args sets
    theirs = argument_utils.core_transformer_config_from_args(theirs_args)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # validate_args sets it off CUDA
    try:
        _, ours = parse_as_the_flow(monkeypatch, [*ARCHITECTURE, *MLA_FLAGS, "--tokenizer-type", "NullTokenizer",
                                                  *BASE], 1)
    finally:
        global_vars.unset_global_variables()
    assert type(ours.transformer) is type(theirs)
    assert {name: getattr(ours, name) for name in MEANING} == {name: getattr(theirs, name) for name in MEANING}
    ours.transformer.perform_initialization = False
    with torch.device("meta"):
        gpt = ours.get_builder_cls()(ours).build_model(ProcessGroupCollection.use_mpu_process_groups())
    attention = gpt.decoder.layers[0].self_attention
    assert isinstance(attention, MLASelfAttention)
    assert tuple(attention.linear_q_down_proj.weight.shape) == (32, 64)
    assert tuple(attention.linear_kv_down_proj.weight.shape) == (16 + 8, 64)
    assert tuple(attention.linear_kv_up_proj.weight.shape) == (4 * (16 + 16), 16)
    assert len(gpt.mtp.layers) == 1 and isinstance(gpt.mtp.layers[0].mtp_model_layer.self_attention, MLASelfAttention)


def test_model_flops_of_deepseek_v3_are_megatron_lms_count():
    """``flow.model_flops``'s FLOPs per token of deepseek-v3 (MLA, dense-first MoE, the MTP layer) against Megatron-LM's
    own ``num_floating_point_operations`` for the same flags, which halves the s x s products for the causal
    mask where the log counts them whole (as it does for every model) and counts MTP's norms as matmuls."""
    from flow.model_flops import model_flops_per_token

    training = pytest.importorskip("megatron.training.training")
    hf, seq = DEEPSEEK_V3, 4096
    args = _megatron_lm_parser().parse_args([
        "--num-layers", "61", "--hidden-size", "7168", "--ffn-hidden-size", "18432", "--num-attention-heads", "128",
        "--seq-length", str(seq), "--max-position-embeddings", "163840", "--swiglu", "--multi-latent-attention",
        "--q-lora-rank", "1536", "--kv-lora-rank", "512", "--qk-head-dim", "128", "--qk-pos-emb-head-dim", "64",
        "--v-head-dim", "128", "--num-experts", "256", "--moe-router-topk", "8", "--moe-ffn-hidden-size", "2048",
        "--moe-shared-expert-intermediate-size", "2048", "--mtp-num-layers", "1", "--micro-batch-size", "1"])
    args.padded_vocab_size, args.moe_layer_freq = hf["vocab_size"], [0] * 3 + [1] * 58
    theirs = training.num_floating_point_operations(args, 1) / seq
    causal_half = 3 * (61 + 1) * seq * hf["num_attention_heads"] * (128 + 64 + 128)
    assert model_flops_per_token(models.get("deepseek-v3"), seq) - causal_half == pytest.approx(theirs, rel=1e-6)


@pytest.mark.parametrize("overrides", [{}, {"add_bias_linear": True, "moe_shared_expert_intermediate_size": None},
                                       {"q_lora_rank": None}, {"q_lora_rank": None, "qk_layernorm": False,
                                                               "mtp_num_layers": 2}])
def test_the_tiny_models_megatron_parameters_are_its_configs(one_rank, overrides):
    """megatron's built model (MTP layers included) counts what the config counts, with a bias on MLA's output
    projection and without a query LoRA too: then with the QK norms only the key/value latent's (DeepSeek-V2-Lite;
    megatron-core 0.19 alone would norm the query projection's input too: adapter/latent_attention.py), without
    them none (the 671B and 1T ones: tests/test_model_configs.py, against Hugging Face's DeepseekV3 too)."""
    from models.provider import build_model, transformer_config

    model = models.get("deepseek-v3-tiny", **overrides)
    with torch.device("meta"):
        gpt = build_model(model, transformer_config(model, perform_initialization=False))
    assert sum(p.numel() for p in gpt.parameters()) == model.num_parameters()


TINY = ["--model", "deepseek-v3-tiny", "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "6",
        "--lr", "3e-3", "--mock-data", "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "0",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "7", "--moe-router-load-balancing-type",
        "seq_aux_loss", "--moe-router-dtype", "fp32"]


def _falls(results: list[dict]) -> dict[int, float]:
    curve = logged_losses(results)
    assert sorted(curve) == list(range(1, 7)) and curve[6] < curve[1] - 0.3, curve
    mtp = printed_losses(results, "mtp_1 loss")  # megatron prints it, not in the step's loss dict
    assert mtp[6] < mtp[1], mtp  # the MTP layer learns too
    return curve


EP2 = [*TINY, "--expert-model-parallel-size", "2"]
# what the one flow says of --model deepseek-v3-tiny before megatron-core 0.19 (models/megatron_lm_args.py): from
# 0.19 --yarn-original-max-position-embeddings says it (patches/latent_attention.py)
BEFORE_0_19 = Version(installed_megatron_core_version()) < Version("0.19")
NO_FLAG = ("before megatron-core 0.19 the one flow refuses --model deepseek-v3-tiny in one line: its "
           "original_max_position_embeddings (64) has no Megatron-LM flag")


@pytest.mark.xfail(BEFORE_0_19, strict=True, reason=NO_FLAG)
def test_the_flow_takes_deepseek_v3_tiny():
    """What the training tests below first need, in the test's own process: --model deepseek-v3-tiny as flags."""
    from flow import model_flags

    assert "--multi-latent-attention" in model_flags.expand(TINY)


@pytest.fixture(scope="module")
def ep2_curve() -> dict[int, float]:
    return _falls(run_ranks(2, run_pretrain, EP2))


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.megatron_training
@pytest.mark.xfail(BEFORE_0_19, strict=True, reason=NO_FLAG)
@pytest.mark.parametrize("world, layout", [
    (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]), (2, ["--pipeline-model-parallel-size", "2"]),
    (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "2"])],
    ids=["tp2", "pp2", "tp2-pp2"])
def test_deepseek_v3_tiny_trains_through_the_flow(world, layout, ep2_curve):
    """At TP2 (with sequence parallelism, which megatron's MoE needs), PP2 (the MTP layer on the last stage), both
    on 4 ranks, and EP2 (``ep2_curve``: 4 of the 8 experts a rank)."""
    _falls(run_ranks(world, run_pretrain, [*TINY, *layout]))


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.megatron_training
@pytest.mark.xfail(BEFORE_0_19, strict=True, reason=NO_FLAG)
def test_deepseek_v3_tiny_through_the_npu_provider_gives_the_torch_providers_curve(ep2_curve):
    """EP2 on the npu provider over the torch_npu double (MLA's core attention on npu_fusion_attention with
    its separate key and value head sizes): the torch provider's curve."""
    runs = run_ranks(2, run_pretrain, EP2, env=NPU_DOUBLE)
    assert "kernels from the npu provider" in runs[0]["stdout"], runs[0]["stdout"][-2000:]
    npu = logged_losses(runs)
    for i in ep2_curve:
        assert npu[i] == pytest.approx(ep2_curve[i], abs=1e-4), (npu, ep2_curve)


@pytest.mark.slow
@pytest.mark.megatron_training
def test_mla_without_a_query_lora_trains_through_the_flow_on_the_npu_provider():
    """Megatron-LM's MLA flags without --q-lora-rank (DeepSeek-V2-Lite's one query projection) at TP2 through the
    flow, on the npu provider over the torch_npu double: the loss and the MTP loss fall."""
    at = MLA_FLAGS.index("--q-lora-rank")
    training = TINY[2:TINY.index("--moe-router-load-balancing-type")]  # deepseek-v3-tiny's, less the router's
    argv = [*ARCHITECTURE, *MLA_FLAGS[:at], *MLA_FLAGS[at + 2:], *training, "--tensor-model-parallel-size", "2",
            "--tokenizer-type", "NullTokenizer"]
    runs = run_ranks(2, run_pretrain, argv, env=NPU_DOUBLE)
    assert "kernels from the npu provider" in runs[0]["stdout"], runs[0]["stdout"][-2000:]
    _falls(runs)


def test_an_mla_model_is_written_as_deepseek_v3_not_as_the_qwen3_it_resembles():
    """A dense MLA model with QK norms would pass for a Qwen3 by its other fields: MLA decides the architecture."""
    from models.hf import architecture_for

    dense_mla = models.get("gpt-tiny", num_query_groups=4, multi_latent_attention=True, q_lora_rank=16,
                           qk_layernorm=True)
    for model in (models.get("deepseek-v3-tiny"), dense_mla):
        assert architecture_for(model) == "DeepseekV3ForCausalLM"

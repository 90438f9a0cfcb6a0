"""Mixture of Experts through the pretrain flow: MoE arguments that cannot run are refused with one message
each before anything is built; the ones that can reach megatron's TransformerConfig with Megatron-LM's
meaning; MoE model configs count the parameters megatron builds and Hugging Face's equivalent models hold,
and route tokens as Hugging Face's routers do; a tiny MoE trained on gloo ranks at EP2 (and EP2 x TP2 with
sequence parallelism) logs its router losses and expert load, resumes bit-exactly and loads at EP1."""

from __future__ import annotations

import argparse
import re

import pytest
import torch

import models
from adapter.training.arguments import moe_freq_type, parse_args, validate_args
from tests.distributed import run_ranks
from tests.pretrain_ranks import run_pretrain_printing, stopped_at
from tests.test_arguments import BASE, assert_refused
from tests.test_memory_plan import QWEN2_57B

MOE = ["--model", "gpt-tiny-moe", *BASE]
DENSE = ["--model", "gpt-tiny", *BASE]
# a MoE model from architecture arguments: Megatron-LM's default linear biases, 4 experts
BARE_MOE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
            "--seq-length", "32", "--vocab-size", "256", "--num-experts", "4", *BASE]

# (arguments, world size, the message's start)
REFUSED = [
    ([*MOE, "--expert-model-parallel-size", "3"], 3, "expert parallel size 3 does not divide num_experts=8"),
    ([*MOE, "--expert-model-parallel-size", "4"], 2,
     "world size 2 is not divisible by expert tensor (1) x expert (4) x pipeline (1) parallel = 4"),
    ([*MOE, "--expert-model-parallel-size", "0"], 2, "--expert-model-parallel-size 0: must be positive"),
    ([*MOE, "--expert-tensor-parallel-size", "3"], 3,
     "expert tensor parallel size 3 does not divide expert_ffn_hidden_size=64"),
    ([*BARE_MOE, "--tensor-model-parallel-size", "2", "--sequence-parallel"], 2,
     "expert tensor parallel size 2 with add_bias_linear=True"),
    ([*MOE, "--tensor-model-parallel-size", "2"], 2, "a MoE model at TP 2 needs --sequence-parallel"),
    ([*MOE, "--num-experts", "-1"], 2, "--num-experts -1: must be zero or more"),
    ([*MOE, "--moe-router-topk", "9"], 2, "moe_router_topk=9 exceeds num_experts=8"),
    ([*MOE, "--moe-router-topk", "1"], 2, "moe_router_topk=1 with the softmax after the top-k"),
    ([*MOE, "--moe-router-enable-expert-bias"], 2,
     "moe_router_enable_expert_bias=True needs moe_router_score_function='sigmoid'"),
    ([*MOE, "--moe-router-topk-scaling-factor", "0"], 2, "moe_router_topk_scaling_factor=0.0: must be positive"),
    ([*MOE, "--moe-layer-freq", "[1,0]"], 2,
     "moe_layer_freq=[1, 0]: a pattern needs one 0 (dense) or 1 (MoE) per layer, 4 in all"),
    ([*MOE, "--moe-shared-expert-gate"], 2, "moe_shared_expert_gate=True without a shared expert"),
    ([*MOE, "--moe-shared-expert-overlap"], 2, "--moe-shared-expert-overlap without a shared expert"),
    (["--model", "gpt-tiny-moe-shared", *BASE, "--moe-shared-expert-overlap"], 2,
     "--moe-shared-expert-overlap runs the shared expert during the all-to-all, which the allgather dispatcher"),
    ([*MOE, "--moe-pad-expert-input-to-capacity"], 2,
     "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor"),
    ([*MOE, "--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss", "--moe-aux-loss-coeff", "0.01"], 2,
     "--moe-router-load-balancing-type aux_loss seq_aux_loss with --moe-aux-loss-coeff 0.01: give one coefficient"),
    ([*MOE, "--moe-aux-loss-coeff", "-0.01"], 2, "--moe-aux-loss-coeff -0.01: must be zero or more"),
    (["--model", "qwen3-moe-tiny", *BASE, "--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss"], 2,
     "--moe-router-load-balancing-type aux_loss seq_aux_loss with the model's one aux-loss coefficient (0.001): "
     "give one coefficient per type"),
    ([*DENSE, "--expert-model-parallel-size", "2"], 2, "--expert-model-parallel-size for a dense model: pass "
                                                        "--num-experts N (or a MoE --model), or drop it"),
    ([*DENSE, "--moe-aux-loss-coeff", "0.01", "--moe-grouped-gemm"], 2,
     "--moe-aux-loss-coeff, --moe-grouped-gemm for a dense model"),
    ([*DENSE, "--moe-router-topk", "4"], 2, "moe_router_topk=4 on a dense model (num_experts=None)"),
]


@pytest.mark.parametrize("argv, world, message", REFUSED, ids=[m[:50] for _, _, m in REFUSED])
def test_each_moe_refusal_names_the_value_and_the_fix(argv, world, message):
    assert_refused(argv, world, message)


def test_moe_arguments_over_a_named_model():
    args = validate_args(parse_args([*MOE, "--moe-layer-freq", "([0]+[1]*1)*2", "--moe-router-topk", "4",
                                     "--expert-model-parallel-size", "2"]), 2)
    assert args.model_config == models.get("gpt-tiny-moe", moe_layer_freq=(0, 1, 0, 1), moe_router_topk=4)
    assert (args.expert_tensor_parallel_size, args.data_parallel_size) == (1, 2)
    # Megatron-LM's --num-experts 0: a dense model, the named model's expert settings dropped
    dense = validate_args(parse_args([*MOE, "--num-experts", "0"]), 2).model_config
    assert dense.num_experts is None and dense.num_parameters() == models.get("gpt-tiny").replace(
        vocab_size=512, max_position_embeddings=64, seq_length=64).num_parameters()


@pytest.mark.parametrize("text, pattern", [
    ("2", 2), ("([0]+[1]*3)*2", [0, 1, 1, 1, 0, 1, 1, 1]), ("[1,0]*2", [1, 0, 1, 0]), ("2*[1]+[0]", [1, 1, 0]),
    (" [1, 1] ", [1, 1]),
])
def test_moe_layer_freq_reads_megatron_lm_patterns(text, pattern):
    assert moe_freq_type(text) == pattern


@pytest.mark.parametrize("text", [
    "[__import__('os').system('true')]", "[1]*10**9", "[1]*1000000", "[[1]]", "[1]+1", "[1]*[2]", "[x for x in (1,)]",
    "[1.5]", "one", "[1]*2*3*4*5*6*7*8*9*10*11",
])
def test_moe_layer_freq_evaluates_nothing_but_lists_of_ints(text):
    with pytest.raises(argparse.ArgumentTypeError):
        moe_freq_type(text)


@pytest.fixture(scope="module")
def one_rank():
    from models.torch_dist_io import single_process_groups

    import adapter  # noqa: F401

    with single_process_groups():
        yield


def test_moe_arguments_reach_the_transformer_config(one_rank):
    """Each MoE argument arrives as the TransformerConfig field of Megatron-LM's name, with its value."""
    from adapter.training.pretrain import transformer_config_overrides
    from models.provider import transformer_config

    argv = ["--model", "gpt-tiny-moe-shared", *BASE, "--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall",
            "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "0.02",
            "--moe-z-loss-coeff", "0.001", "--moe-expert-capacity-factor", "1.5", "--moe-pad-expert-input-to-capacity",
            "--moe-token-drop-policy", "position", "--moe-router-dtype", "fp32", "--moe-per-layer-logging",
            "--moe-router-topk-scaling-factor", "2.5", "--moe-layer-freq", "[0,1,1,1]", "--moe-shared-expert-overlap",
            "--moe-router-bias-update-rate", "0.01", "--moe-permute-fusion"]
    args = validate_args(parse_args(argv), 1)
    config = transformer_config(args.model_config, **transformer_config_overrides(args))
    expected = dict(
        num_moe_experts=8, moe_ffn_hidden_size=64, moe_router_topk=2, moe_layer_freq=[0, 1, 1, 1],
        moe_shared_expert_intermediate_size=128, moe_shared_expert_gate=True, moe_router_pre_softmax=True,
        moe_router_score_function="softmax", moe_router_topk_scaling_factor=2.5, moe_grouped_gemm=True,
        moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.02,
        moe_z_loss_coeff=0.001, moe_expert_capacity_factor=1.5, moe_pad_expert_input_to_capacity=True,
        moe_token_drop_policy="position", moe_router_dtype="fp32", moe_per_layer_logging=True,
        moe_shared_expert_overlap=True, moe_router_bias_update_rate=0.01, moe_permute_fusion=True,
        expert_model_parallel_size=1, expert_tensor_parallel_size=1)
    assert {name: getattr(config, name) for name in expected} == expected


@pytest.mark.parametrize("name, given, coeff", [
    ("qwen3-30b-a3b", [], 1e-3), ("qwen3-moe-tiny", [], 1e-3), ("gpt-tiny-moe", [], 0.0),
    ("qwen3-moe-tiny", ["--moe-aux-loss-coeff", "0.02"], 0.02), ("qwen3-moe-tiny", ["--moe-aux-loss-coeff", "0"], 0.0),
    ("qwen3-moe-tiny", ["--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss", "--moe-aux-loss-coeff",
                        "0.01", "0.02"], [0.01, 0.02]),
], ids=["qwen3-30b-a3b", "qwen3-moe-tiny", "published without", "given", "given 0", "one per type"])
def test_the_aux_loss_coefficient_is_the_named_models_unless_given(one_rank, name, given, coeff):
    """Without --moe-aux-loss-coeff a named MoE model trains with the coefficient it was published with
    (Qwen3-MoE's router_aux_loss_coef, 1e-3; a model without one, 0 as Megatron-LM's default); a given one wins."""
    from adapter.training.pretrain import transformer_config_overrides
    from models.provider import transformer_config

    args = validate_args(parse_args(["--model", name, *BASE, *given]), 1)
    assert args.moe_aux_loss_coeff == coeff
    assert transformer_config(args.model_config, **transformer_config_overrides(args)).moe_aux_loss_coeff == coeff


def _megatron_parameters(model, **settings) -> int:
    from models.provider import build_model, transformer_config

    with torch.device("meta"):
        gpt = build_model(model, transformer_config(model, perform_initialization=False, **settings))
    return sum(p.numel() for p in gpt.parameters())


VARIANTS = {
    "every layer": models.get("gpt-tiny-moe"),
    "shared gated expert": models.get("gpt-tiny-moe-shared"),
    "every other layer, qk norm": models.get("gpt-tiny-moe", moe_layer_freq=2, qk_layernorm=True),
    "pattern, biases": models.get("gpt-tiny-moe", moe_layer_freq=(0, 1, 1, 0), add_bias_linear=True,
                                  add_qkv_bias=True, tie_embeddings=True),
    "LayerNorm, GeLU, positions": models.get("gpt-125m", num_layers=2, num_experts=4, moe_ffn_hidden_size=256,
                                             moe_router_topk=1, moe_router_pre_softmax=True),
    "sigmoid, expert bias": models.get("gpt-tiny-moe", moe_router_score_function="sigmoid",
                                       moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=2.5),
}


@pytest.mark.parametrize("grouped", [False, True], ids=["sequential", "grouped"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_moe_parameter_count_equals_megatrons(one_rank, name, grouped):
    model = VARIANTS[name]
    assert _megatron_parameters(model, moe_grouped_gemm=grouped) == model.num_parameters()


def _hf_moe(model, architecture: str):
    """The Hugging Face model of ``model``'s architecture, on the meta device: Mixtral (experts in every
    layer, nothing shared), Qwen2-MoE (a gated shared expert) or Qwen3-MoE (query and key norms)."""
    transformers = pytest.importorskip("transformers")
    dense_layers = [i for i, moe in enumerate(model.moe_layer_pattern()) if not moe]
    common = dict(vocab_size=model.vocab_size, hidden_size=model.hidden_size, num_hidden_layers=model.num_layers,
                  num_attention_heads=model.num_attention_heads, num_key_value_heads=model.num_query_groups,
                  max_position_embeddings=model.max_position_embeddings, tie_word_embeddings=model.tie_embeddings,
                  num_experts_per_tok=model.moe_router_topk)
    if architecture == "MixtralForCausalLM":
        assert not dense_layers
        config = transformers.MixtralConfig(**common, intermediate_size=model.expert_ffn_hidden_size,
                                            num_local_experts=model.num_experts)
    else:
        moe = dict(intermediate_size=model.ffn_hidden_size, moe_intermediate_size=model.expert_ffn_hidden_size,
                   num_experts=model.num_experts, mlp_only_layers=dense_layers, decoder_sparse_step=1,
                   norm_topk_prob=not model.moe_router_pre_softmax)
        if architecture == "Qwen2MoeForCausalLM":
            config = transformers.Qwen2MoeConfig(**common, **moe, qkv_bias=model.add_qkv_bias,
                                                 shared_expert_intermediate_size=model.moe_shared_expert_intermediate_size)
        else:
            config = transformers.Qwen3MoeConfig(**common, **moe, attention_bias=False)
    with torch.device("meta"):
        return getattr(transformers, architecture)(config)


HF_EQUIVALENTS = [
    ("MixtralForCausalLM", models.get("gpt-tiny-moe")),
    ("Qwen2MoeForCausalLM", models.get("gpt-tiny-moe-shared")),
    ("Qwen2MoeForCausalLM", models.get("gpt-tiny-moe-shared", add_qkv_bias=True, moe_layer_freq=(0, 1, 0, 1))),
    ("Qwen3MoeForCausalLM", models.get("gpt-tiny-moe", qk_layernorm=True, moe_layer_freq=(1, 1, 1, 0))),
    ("Qwen2MoeForCausalLM", QWEN2_57B),  # Qwen2-57B-A14B, 57.4B parameters
]


@pytest.mark.parametrize("architecture, model", HF_EQUIVALENTS,
                         ids=[f"{a}-{m.num_parameters() / 1e6:.1f}M" for a, m in HF_EQUIVALENTS])
def test_moe_parameter_count_equals_hugging_faces(one_rank, architecture, model):
    hf = _hf_moe(model, architecture)
    assert sum(p.numel() for p in hf.parameters()) == model.num_parameters() == _megatron_parameters(model)


@pytest.mark.parametrize("pre_softmax", [True, False], ids=["qwen2-moe", "qwen3-moe"])
def test_the_router_routes_as_hugging_faces(one_rank, pre_softmax):
    """Megatron's router of a ModelConfig against Hugging Face's of the same weight: Qwen2-MoE's softmax
    over all experts (norm_topk_prob=False) is moe_router_pre_softmax; Qwen3-MoE's renormalised top-k
    (norm_topk_prob=True) is the softmax after the top-k."""
    from models.provider import build_model, transformer_config

    model = models.get("gpt-tiny-moe-shared", moe_router_pre_softmax=pre_softmax)
    torch.manual_seed(0)
    router = build_model(model, transformer_config(model)).decoder.layers[0].mlp.router.eval()
    hf = _hf_moe(model, "Qwen2MoeForCausalLM" if pre_softmax else "Qwen3MoeForCausalLM").model.layers[0].mlp.gate
    hf = hf.to_empty(device="cpu")
    with torch.no_grad():
        hf.weight.copy_(router.weight)
        tokens = torch.randn(16, 1, model.hidden_size)
        probs, routing_map = router(tokens)
        _, scores, indices = hf(tokens)
    assert torch.equal(routing_map.nonzero()[:, 1].view(16, -1).sort().values, indices.sort().values)
    torch.testing.assert_close(probs.gather(1, indices), scores)


def test_sigmoid_routing_with_expert_bias_and_scaling(one_rank):
    """DeepSeek-V3's router by hand: sigmoid scores, the top k by score + expert bias, those scores
    renormalised and multiplied by the scaling factor."""
    from models.provider import build_model, transformer_config

    model = VARIANTS["sigmoid, expert bias"]
    torch.manual_seed(0)
    router = build_model(model, transformer_config(model)).decoder.layers[0].mlp.router.eval()
    with torch.no_grad():
        router.expert_bias.copy_(torch.linspace(-0.5, 0.5, model.num_experts))
        tokens = torch.randn(16, 1, model.hidden_size)
        probs, _ = router(tokens)
        scores = torch.sigmoid(tokens.view(16, -1) @ router.weight.t())
    chosen = (scores + router.expert_bias).topk(model.moe_router_topk, dim=1).indices
    picked = scores.gather(1, chosen)
    torch.testing.assert_close(probs.gather(1, chosen), 2.5 * picked / picked.sum(dim=1, keepdim=True))


# ---------------------------------------------------------------------------------------------------------
# the flow on gloo ranks


def _argv(iters: int, ep: int, tp: int = 1, *extra: str) -> list[str]:
    return ["--model", "gpt-tiny-moe", "--expert-model-parallel-size", str(ep), "--tensor-model-parallel-size",
            str(tp), *(["--sequence-parallel"] if tp > 1 else []), "--micro-batch-size", "2",
            "--global-batch-size", "8", "--seq-length", "32", "--train-iters", str(iters), "--lr", "3e-3",
            "--lr-warmup-iters", "2", "--mock-data", "--log-interval", "1", "--eval-interval", "1000", "--eval-iters",
            "0", "--hidden-dropout", "0", "--attention-dropout", "0", "--use-distributed-optimizer",
            "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3", "--seed", "7", *extra]


def _logged(results: list[dict]) -> tuple[dict[int, float], str]:
    """(iteration -> lm loss of the rank that logged (the last), what every rank printed)."""
    losses = {entry["iteration"]: entry["lm loss"] for entry in results[-1]["train"]}
    return losses, "".join(result["stdout"] for result in results)


def _check_moe_logs(printed: str, iterations: int, tensorboard) -> None:
    """Each iteration line carries the router losses (Megatron-LM's names) and the expert load, and
    TensorBoard the same, per layer too (--moe-per-layer-logging): each layer's tokens shared out over its
    experts."""
    from scripts.plot_loss import read_scalars

    scalars = {tag: dict(values) for tag, values in read_scalars(tensorboard).items()}
    lines = [line for line in printed.splitlines() if line.startswith(" iteration")]
    assert len(lines) == iterations, printed[-3000:]
    for iteration, line in enumerate(lines, start=1):
        fields = dict(field.strip().split(": ", 1) for field in line.strip(" |").split(" | ") if ": " in field)
        assert 0.5 < float(fields["load_balancing_loss"]) < 2.0  # 1 when the experts are evenly loaded
        assert float(fields["z_loss"]) > 0
        load = re.fullmatch(r"([0-9.]+) \(worst: layer (\d) ([0-9.]+)\)", fields["expert load max/mean"])
        assert 1.0 <= float(load[1]) <= float(load[3]) <= 8.0  # max/mean tokens per expert, of 8 experts
        for name in ("load_balancing_loss", "z_loss"):
            assert scalars[name][iteration] == pytest.approx(float(fields[name]), rel=1e-5)
            assert sum(scalars[f"moe/{name}_layer_{layer}"][iteration] for layer in range(4)) / 4 == pytest.approx(
                scalars[name][iteration], rel=1e-5)
        assert scalars["expert-load-max-over-mean"][iteration] == pytest.approx(float(load[1]), abs=1e-3)
        assert scalars[f"moe/expert_load_max_over_mean_layer_{load[2]}"][iteration] == pytest.approx(
            float(load[3]), abs=1e-3)
        for layer in range(4):
            shares = [scalars[f"moe/tokens_per_expert_layer_{layer}/expert_{e}"][iteration] for e in range(8)]
            assert sum(shares) == pytest.approx(1.0) and max(shares) * 8 == pytest.approx(
                scalars[f"moe/expert_load_max_over_mean_layer_{layer}"][iteration], rel=1e-5)


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("experts", [(), ("--moe-grouped-gemm",)], ids=["sequential", "grouped"])
def test_ep2_trains_logs_resumes_bit_exactly_and_loads_at_ep1_and_back(tmp_path, experts):
    """EP2 (x DP2 for the dense part) on 2 ranks: the loss falls and the lines carry the router losses and
    expert load; stopped at 4 and resumed, the curve is the uninterrupted one bit for bit; loaded on one
    rank (EP1, DP1: all 8 experts and the whole batch there), and from there back at EP2, it continues it up
    to reduction order. ``grouped``: the same with the grouped experts (one parameter per projection, each
    expert's tensors and Adam states checkpointed on their own)."""
    tensorboard, saved = tmp_path / "tensorboard", tmp_path / "saved"
    reference, printed = _logged(run_ranks(2, run_pretrain_printing, _argv(
        8, 2, 1, "--tensorboard-dir", str(tensorboard), "--moe-per-layer-logging", "--save", str(saved),
        "--save-interval", "4", *experts)))
    assert sorted(reference) == list(range(1, 9)) and reference[8] < reference[1] - 0.3
    _check_moe_logs(printed, 8, tensorboard)
    checkpoints = stopped_at(saved, 4, tmp_path / "checkpoints")
    resumed, printed = _logged(run_ranks(2, run_pretrain_printing, _argv(8, 2, 1, "--load", str(checkpoints),
                                                                         *experts)))
    assert f"loaded {checkpoints / 'iter_0000004'} (iteration 4)" in printed
    assert resumed == {i: reference[i] for i in range(5, 9)}
    # megatron gives the experts an optimizer of their own at EP > 1 only: the saved param groups are fitted
    at_ep1, printed = _logged(run_ranks(1, run_pretrain_printing, _argv(
        8, 1, 1, "--load", str(checkpoints), "--save", str(tmp_path / "at_ep1"), "--exit-interval", "6", *experts)))
    assert "RNG states not restored" in printed
    assert sorted(at_ep1) == [5, 6]
    back_at_ep2, _ = _logged(run_ranks(2, run_pretrain_printing, _argv(8, 2, 1, "--load", str(tmp_path / "at_ep1"),
                                                                       *experts)))
    assert sorted(back_at_ep2) == [7, 8]
    for i, loss in {**at_ep1, **back_at_ep2}.items():
        assert loss == pytest.approx(reference[i], abs=2e-4)


@pytest.mark.slow
@pytest.mark.multiproc
def test_ep2_tp2_with_sequence_parallel_trains_and_resumes_bit_exactly(tmp_path):
    """4 ranks: TP2 x DP2 for the dense part, EP2 x expert TP2 for the experts, sequence parallel."""
    saved = tmp_path / "saved"
    reference, _ = _logged(run_ranks(4, run_pretrain_printing, _argv(6, 2, 2, "--save", str(saved),
                                                                     "--save-interval", "3")))
    assert reference[6] < reference[1]
    resumed, _ = _logged(run_ranks(4, run_pretrain_printing, _argv(6, 2, 2, "--load",
                                                                   str(stopped_at(saved, 3, tmp_path / "at3")))))
    assert resumed == {i: reference[i] for i in range(4, 7)}

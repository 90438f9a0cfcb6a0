"""Mixture of Experts through the one flow (scripts/pretrain_gpt.py on megatron.training's own parser, with the
adapter's patches): MoE arguments that cannot run are refused with one line each before anything is built; the
ones that can reach megatron's TransformerConfig with Megatron-LM's meaning; MoE model configs count the
parameters megatron builds and Hugging Face's equivalent models hold, and route tokens as Hugging Face's
routers do; a tiny MoE trained on gloo ranks at EP2 (and EP2 x TP2 with sequence parallelism) logs its router
losses and expert load and resumes bit-exactly (loading it at EP1, which megatron.training cannot, is xfail)."""

from __future__ import annotations

import dataclasses
import re
import sys

import pytest
import torch

import models
from adapter.cuda_only_features import RefusedSetting
from flow import model_flags
from tests.distributed import launch_script, run_ranks
from tests.flow_ranks import logged_losses, run_pretrain, stopped_at
from tests.test_flow_arguments import BARE, BASE, parse_as_the_flow
from tests.test_memory_plan import QWEN2_57B

MOE = ["--model", "gpt-tiny-moe", *BASE]
DENSE = ["--model", "gpt-tiny", *BASE]
# a MoE model from architecture arguments: Megatron-LM's default linear biases, 4 experts
BARE_MOE = [*BARE, "--num-experts", "4"]
SIX = ["--global-batch-size", "6"]  # divisible at 3 ranks

# (arguments, world size, the line's start): megatron's own checks said in one line, and those megatron lacks
# (adapter/moe_refusals.py)
REFUSED = [
    ([*MOE, "--expert-model-parallel-size", "3", *SIX], 3,
     "--expert-model-parallel-size 3, --num-experts 8: Number of experts should be a multiple of expert model "
     "parallel_size."),
    ([*MOE, "--expert-model-parallel-size", "4"], 2,
     "world size 2 is not divisible by expert tensor (1) x expert (4) x pipeline (1) parallel = 4"),
    ([*MOE, "--expert-model-parallel-size", "0"], 2, "--expert-model-parallel-size 0: must be positive"),
    ([*MOE, "--expert-tensor-parallel-size", "3", *SIX], 3,
     "expert tensor parallel size 3 does not divide the experts' FFN size 64 (--moe-ffn-hidden-size)"),
    ([*BARE_MOE, "--tensor-model-parallel-size", "2", "--sequence-parallel"], 2,
     "without --disable-bias-linear, --expert-tensor-parallel-size 2: Bias in Moe is only supported when ETP==1"),
    ([*MOE, "--tensor-model-parallel-size", "2"], 2, "a MoE model at TP 2 needs --sequence-parallel"),
    ([*MOE, "--num-experts", "-1"], 2, "--num-experts -1: must be zero or more"),
    ([*MOE, "--moe-router-topk", "9"], 2, "--moe-router-topk 9 exceeds --num-experts 8"),
    ([*MOE, "--moe-router-topk", "1"], 2,
     "--moe-router-topk 1, --moe-router-score-function softmax, without --moe-router-pre-softmax, "
     "--moe-router-load-balancing-type aux_loss: Please use --moe-router-pre-softmax when topk is 1."),
    ([*MOE, "--moe-router-enable-expert-bias"], 2,
     "--moe-router-enable-expert-bias, --moe-router-score-function softmax: Expert bias for aux-loss-free routing "
     "only supports 'sigmoid' and 'sqrtsoftplus' score functions."),
    ([*MOE, "--moe-router-topk-scaling-factor", "0"], 2, "--moe-router-topk-scaling-factor 0.0: must be positive"),
    ([*MOE, "--moe-layer-freq", "[1,0]"], 2,
     "--moe-layer-freq 1 0: a pattern needs one 0 (dense) or 1 (MoE) per layer, 4 in all"),
    ([*MOE, "--moe-shared-expert-gate"], 2, "--moe-shared-expert-gate without a shared expert"),
    ([*MOE, "--moe-shared-expert-overlap"], 2, "--moe-shared-expert-overlap without a shared expert"),
    (["--model", "gpt-tiny-moe-shared", *BASE, "--moe-shared-expert-overlap"], 2,
     "--moe-shared-expert-overlap, --moe-token-dispatcher-type allgather: moe_shared_expert_overlap only works "
     "with alltoall or flex token dispatcher."),
    ([*MOE, "--moe-pad-expert-input-to-capacity"], 2,
     "--moe-expert-capacity-factor unset: moe_expert_capacity_factor must be set to use "
     "moe_pad_expert_input_to_capacity"),
    ([*MOE, "--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss", "--moe-aux-loss-coeff", "0.01"], 2,
     "--moe-router-load-balancing-type aux_loss seq_aux_loss, --moe-aux-loss-coeff 0.01: moe_aux_loss_coeff must "
     "be a list of the same length as moe_router_load_balancing_type"),
    ([*MOE, "--moe-aux-loss-coeff", "-0.01"], 2, "--moe-aux-loss-coeff -0.01: must be zero or more"),
    # the model's one coefficient (Qwen3-MoE's 0.001) with two types
    (["--model", "qwen3-moe-tiny", *BASE, "--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss"], 2,
     "--moe-router-load-balancing-type aux_loss seq_aux_loss, --moe-aux-loss-coeff 0.001: moe_aux_loss_coeff must "
     "be a list of the same length as moe_router_load_balancing_type"),
    ([*DENSE, "--expert-model-parallel-size", "2"], 2,
     "--expert-model-parallel-size 2, --num-experts unset: num_experts must be non None to use expert model "
     "parallelism"),
    ([*DENSE, "--moe-aux-loss-coeff", "0.01", "--moe-grouped-gemm"], 2,
     "--moe-aux-loss-coeff 0.01, --moe-grouped-gemm for a dense model"),
    ([*DENSE, "--moe-router-topk", "4"], 2, "--moe-router-topk 4 for a dense model"),
]


@pytest.fixture
def parse(monkeypatch):
    """``parse_as_the_flow`` (tests/test_flow_arguments.py) at a world size, megatron.training's globals it
    sets (arguments, tokenizer, micro-batch calculator) unset after each parse; CUDA_DEVICE_MAX_CONNECTIONS,
    which validate_args sets off CUDA, restored (see tests/test_input_refusals.py)."""
    from megatron.core import num_microbatches_calculator
    from megatron.training import global_vars

    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")

    def parsed(argv: list[str], world: int):
        try:
            return parse_as_the_flow(monkeypatch, argv, world)
        finally:
            global_vars.unset_global_variables()
            num_microbatches_calculator.unset_num_microbatches_calculator()

    return parsed


REFUSED = [row if hasattr(row, "marks") else pytest.param(*row, id=row[2][:50]) for row in REFUSED]


@pytest.mark.parametrize("argv, world, line", REFUSED)
def test_each_moe_refusal_is_one_line_naming_the_value(parse, capsys, argv, world, line):
    with pytest.raises(RefusedSetting) as refused:
        parse(argv, world)
    assert str(refused.value).startswith(line) and "\n" not in str(refused.value), str(refused.value)
    assert "usage:" not in capsys.readouterr().err


def _fields(config) -> dict:
    """A GPT model config's plain settings, its TransformerConfig's too (functions and process groups left out)."""
    plain = (int, float, str, bool, list, tuple, type(None))

    def settings(fields) -> dict:
        return {f.name: getattr(fields, f.name) for f in dataclasses.fields(fields)
                if isinstance(getattr(fields, f.name), plain)}

    return {**settings(config), **settings(config.transformer)}


def test_moe_arguments_over_a_named_model(parse):
    """--moe-layer-freq and --moe-router-topk over --model gpt-tiny-moe: the config of that model with the two
    changed (as its own flags give it); EP2 at 2 ranks leaves the dense part DP2."""
    args, config = parse([*MOE, "--moe-layer-freq", "([0]+[1]*1)*2", "--moe-router-topk", "4",
                          "--expert-model-parallel-size", "2"], 2)
    assert (args.expert_tensor_parallel_size, args.data_parallel_size) == (1, 2)
    changed = models.get("gpt-tiny-moe", moe_layer_freq=(0, 1, 0, 1), moe_router_topk=4)
    _, want = parse([*model_flags.flow_flags(changed), *BASE, "--expert-model-parallel-size", "2"], 2)
    assert (config.moe_layer_freq, config.moe_router_topk, config.num_moe_experts) == ([0, 1, 0, 1], 4, 8)
    assert _fields(config) == _fields(want)


def test_num_experts_0_makes_a_named_moe_model_dense(parse):
    """Megatron-LM's --num-experts 0: a dense model, the named model's expert settings dropped."""
    _, dense = parse([*MOE, "--num-experts", "0"], 2)
    assert dense.num_moe_experts is None and dense.moe_ffn_hidden_size is None


def _layer_freq(monkeypatch, text: str):
    """--moe-layer-freq ``text`` as megatron.training's parser, with the adapter's patches, reads it."""
    from megatron.training.arguments import parse_args

    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--moe-layer-freq", text])
    return parse_args().moe_layer_freq


@pytest.mark.parametrize("text, pattern", [
    ("2", 2), ("([0]+[1]*3)*2", [0, 1, 1, 1, 0, 1, 1, 1]), ("[1,0]*2", [1, 0, 1, 0]), ("2*[1]+[0]", [1, 1, 0]),
    (" [1, 1] ", [1, 1]),  # megatron's own check refuses the spaces; adapter/moe_layer_pattern.py reads them
])
def test_moe_layer_freq_reads_megatron_lm_patterns(monkeypatch, text, pattern):
    assert _layer_freq(monkeypatch, text) == pattern


@pytest.mark.parametrize("text", [
    "[__import__('os').system('true')]", "[1]*10**9", "[1]*1000000", "[[1]]", "[1]+1", "[1]*[2]",
    "[x for x in (1,)]", "[1.5]", "one", "[1]*2*3*4*5*6*7*8*9*10*11", "[1]*-3",
])
def test_moe_layer_freq_evaluates_nothing_but_lists_of_ints(monkeypatch, text):
    """megatron's ``_eval_pattern`` evals any text of digits, brackets, commas, + and *: a power or a long
    repeat built its list before any check (``[1]*10**9``: a billion entries), and a list of lists passed.
    Read by adapter/moe_layer_pattern.py, each is argparse's usage error for the flag, at once."""
    with pytest.raises(RefusedSetting) as refused:
        _layer_freq(monkeypatch, text)
    assert str(refused.value).startswith("argument --moe-layer-freq: invalid moe_freq_type value")


@pytest.fixture(scope="module")
def one_rank():
    from models.torch_dist_io import single_process_groups

    import adapter  # noqa: F401

    with single_process_groups():
        yield


def test_moe_arguments_reach_the_transformer_config(parse):
    """Each MoE argument arrives as the TransformerConfig field of Megatron-LM's name, with its value."""
    argv = ["--model", "gpt-tiny-moe-shared", *BASE, "--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall",
            "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "0.02",
            "--moe-z-loss-coeff", "0.001", "--moe-expert-capacity-factor", "1.5", "--moe-pad-expert-input-to-capacity",
            "--moe-token-drop-policy", "position", "--moe-router-dtype", "fp32", "--moe-per-layer-logging",
            "--moe-router-topk-scaling-factor", "2.5", "--moe-layer-freq", "[0,1,1,1]", "--moe-shared-expert-overlap",
            "--moe-router-bias-update-rate", "0.01", "--moe-permute-fusion"]
    _, config = parse(argv, 1)
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
def test_the_aux_loss_coefficient_is_the_named_models_unless_given(parse, name, given, coeff):
    """Without --moe-aux-loss-coeff a named MoE model trains with the coefficient it was published with
    (Qwen3-MoE's router_aux_loss_coef, 1e-3; a model without one, 0 as Megatron-LM's default); a given one wins."""
    args, config = parse(["--model", name, *BASE, *given], 1)
    assert args.moe_aux_loss_coeff == coeff and config.moe_aux_loss_coeff == coeff


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
    """(iteration -> lm loss of the rank that logged it, what every rank printed)."""
    return logged_losses(results), "".join(result["stdout"] for result in results)


def _fields_of(line: str) -> dict[str, str]:
    return dict(field.strip().split(": ", 1) for field in line.strip(" |").split(" | ") if ": " in field)


def _check_moe_logs(printed: str, iterations: int, tensorboard) -> None:
    """Each of megatron's iteration lines carries the router losses (Megatron-LM's names) and the adapter's line
    after it the expert load, and TensorBoard the same (each iteration's own), per layer too
    (--moe-per-layer-logging): each layer's tokens shared out over its experts."""
    from scripts.plot_loss import read_scalars

    scalars = {tag: dict(values) for tag, values in read_scalars(tensorboard).items()}
    lines = [line for line in printed.splitlines() if re.search(r"\] iteration +\d+/", line)]
    loads = [line for line in printed.splitlines() if line.startswith("[adapter] iteration")]
    assert len(lines) == len(loads) == iterations, printed[-3000:]
    for iteration, (line, load_line) in enumerate(zip(lines, loads), start=1):
        fields = _fields_of(line)
        assert 0.5 < float(fields["load_balancing_loss"]) < 2.0  # 1 when the experts are evenly loaded
        assert float(fields["z_loss"]) > 0
        load = re.fullmatch(r"([0-9.]+) \(worst: layer (\d) ([0-9.]+)\)", _fields_of(load_line)["expert load max/mean"])
        assert 1.0 <= float(load[1]) <= float(load[3]) <= 8.0  # max/mean tokens per expert, of 8 experts
        # megatron logs iteration 1 without resetting its sums: the line of 2 is the mean over 1 and 2
        covered = [1, 2] if iteration == 2 else [iteration]
        for name in ("load_balancing_loss", "z_loss"):
            assert sum(scalars[name][i] for i in covered) / len(covered) == pytest.approx(float(fields[name]),
                                                                                         rel=1e-5)
            assert sum(scalars[f"moe/{name}_layer_{layer}"][iteration] for layer in range(4)) / 4 == pytest.approx(
                scalars[name][iteration], rel=1e-5)
        assert scalars["expert-load-max-over-mean"][iteration] == pytest.approx(float(load[1]), abs=1e-3)
        assert scalars[f"moe/expert_load_max_over_mean_layer_{load[2]}"][iteration] == pytest.approx(
            float(load[3]), abs=1e-3)
        for layer in range(4):
            shares = [scalars[f"moe/tokens_per_expert_layer_{layer}/expert_{e}"][iteration] for e in range(8)]
            assert sum(shares) == pytest.approx(1.0) and max(shares) * 8 == pytest.approx(
                scalars[f"moe/expert_load_max_over_mean_layer_{layer}"][iteration], rel=1e-5)


EXPERTS = pytest.mark.parametrize("experts", [(), ("--moe-grouped-gemm",)], ids=["sequential", "grouped"])


@pytest.mark.multiproc  # starts ranks for the tests below (tests/test_markers.py reads the mark)
def _ep2_reference(tmp_path, experts: tuple, *extra: str) -> tuple[dict[int, float], str, object]:
    """EP2 over 8 iterations saved at 4: (its curve, what its ranks printed, a save directory stopped at 4)."""
    saved = tmp_path / "saved"
    reference, printed = _logged(run_ranks(2, run_pretrain, _argv(8, 2, 1, "--save", str(saved), "--save-interval",
                                                                  "4", *extra, *experts)))
    assert sorted(reference) == list(range(1, 9)) and reference[8] < reference[1] - 0.3
    return reference, printed, stopped_at(saved, 4, tmp_path / "checkpoints")


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.megatron_training
@EXPERTS
def test_ep2_trains_logs_and_resumes_bit_exactly(tmp_path, experts):
    """EP2 (x DP2 for the dense part) on 2 ranks: the loss falls and the lines carry the router losses and
    expert load; stopped at 4 and resumed, the curve is the uninterrupted one bit for bit. ``grouped``: the
    same with the grouped experts (one parameter per projection)."""
    tensorboard = tmp_path / "tensorboard"
    reference, printed, checkpoints = _ep2_reference(tmp_path, experts, "--tensorboard-dir", str(tensorboard),
                                                     "--moe-per-layer-logging")
    _check_moe_logs(printed, 8, tensorboard)
    resumed, printed = _logged(run_ranks(2, run_pretrain, _argv(8, 2, 1, "--load", str(checkpoints), *experts)))
    assert f"successfully loaded checkpoint from {checkpoints}" in printed and "at iteration 4" in printed
    assert resumed == {i: reference[i] for i in range(5, 9)}


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.megatron_training
def test_an_ep2_checkpoint_at_ep1_is_refused_in_one_line_and_its_weights_load_without_the_optimizer(tmp_path):
    """At EP > 1 megatron-core gives the experts an optimizer of their own (a ChainedOptimizer), and its
    ``load_state_dict`` reads a state only into the split that saved it: megatron's KeyError on every rank
    becomes one line with the ways out (Megatron-LM's pretrain_gpt.py fails the same way). With
    --no-load-optim, the way out it names, EP2's weights at 4 give EP2's loss at 5 on one rank."""
    reference, _, checkpoints = _ep2_reference(tmp_path, ())
    refused = launch_script("scripts/pretrain_gpt.py", [*_argv(8, 1, 1), "--load", checkpoints], world_size=1)
    (status, output), = refused
    last = output.strip().splitlines()[-1]
    assert status == 2 and "Traceback" not in output, output[-3000:]
    assert last.startswith(f"error: --load {checkpoints}: the checkpoint's optimizer state is split into another "
                           "number of optimizers than this run's") and "--no-load-optim" in last, last
    weights_only, _ = _logged(run_ranks(1, run_pretrain, _argv(8, 1, 1, "--load", str(checkpoints),
                                                               "--no-load-optim", "--exit-interval", "5")))
    assert weights_only[5] == pytest.approx(reference[5], abs=2e-4)


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.megatron_training
def test_ep2_tp2_with_sequence_parallel_trains_and_resumes_bit_exactly(tmp_path):
    """4 ranks: TP2 x DP2 for the dense part, EP2 x expert TP2 for the experts, sequence parallel."""
    saved = tmp_path / "saved"
    reference, _ = _logged(run_ranks(4, run_pretrain, _argv(6, 2, 2, "--save", str(saved),
                                                                     "--save-interval", "3")))
    assert reference[6] < reference[1]
    resumed, _ = _logged(run_ranks(4, run_pretrain, _argv(6, 2, 2, "--load",
                                                                   str(stopped_at(saved, 3, tmp_path / "at3")))))
    assert resumed == {i: reference[i] for i in range(4, 7)}

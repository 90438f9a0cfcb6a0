"""Megatron-LM's recipes as written (issue 43): ``--transformer-impl transformer_engine`` without Transformer
Engine, ``--moe-grouped-gemm`` off CUDA, selective recompute of every module.

The validate_args wraps are tested here against a stand-in validate_args (Transformer Engine faked importable
and not); the checkpoint keys with megatron-core directly; both run in CI. The tests marked ``megatron_lm``
run Megatron-LM's own pretrain_gpt.py through ``torchrun -m adapter.run`` (tests/test_megatron_lm.py's runner).
"""

from __future__ import annotations

import argparse

import pytest

import adapter  # noqa: F401 - before the patches, as a user script does
from adapter.kernels import cuda_provider
from patches.megatron_lm_recipes import grouped_gemm_without_compute_capability, local_spec_without_transformer_engine
from tests.distributed import run_ranks
from tests.spec_keys_ranks import save_and_load_keys

# The keys of megatron's TE layer spec for this GPT (RMSNorm, no biases): TE's fused norm+linear layers hold the
# norms as ``layer_norm_weight`` of linear_qkv and linear_fc1.
TE_SPEC_KEYS = ["decoder.final_layernorm.weight", "decoder.layers.mlp.linear_fc1.layer_norm_weight",
                "decoder.layers.mlp.linear_fc1.weight", "decoder.layers.mlp.linear_fc2.weight",
                "decoder.layers.self_attention.linear_proj.weight",
                "decoder.layers.self_attention.linear_qkv.layer_norm_weight",
                "decoder.layers.self_attention.linear_qkv.weight", "embedding.word_embeddings.weight",
                "output_layer.weight"]


def _validated(wrapper, **args):
    """What the wrapped validate_args saw, and the arguments after it."""
    seen = {}

    def validate_args(namespace, defaults=None):
        seen.update(vars(namespace))
        return namespace

    namespace = argparse.Namespace(rank=0, **args)
    return seen, wrapper(validate_args)(namespace)


@pytest.mark.parametrize("impl", ["transformer_engine", "local"])
def test_without_transformer_engine_both_spellings_validate_as_the_local_spec(monkeypatch, capsys, impl):
    monkeypatch.setattr(cuda_provider, "HAVE_TE", False)
    seen, args = _validated(local_spec_without_transformer_engine, transformer_impl=impl)
    assert seen["transformer_impl"] == args.transformer_impl == "local"
    lines = [line for line in capsys.readouterr().out.splitlines() if "--transformer-impl" in line]
    assert len(lines) == (impl == "transformer_engine")


def test_with_transformer_engine_importable_it_stays_transformer_engine(monkeypatch, capsys):
    monkeypatch.setattr(cuda_provider, "HAVE_TE", True)
    seen, args = _validated(local_spec_without_transformer_engine, transformer_impl="transformer_engine")
    assert seen["transformer_impl"] == args.transformer_impl == "transformer_engine"
    assert capsys.readouterr().out == ""


def test_the_line_comes_from_rank_0_only(monkeypatch, capsys):
    monkeypatch.setattr(cuda_provider, "HAVE_TE", False)
    local_spec_without_transformer_engine(lambda args: args)(
        argparse.Namespace(rank=1, transformer_impl="transformer_engine"))
    assert capsys.readouterr().out == ""


def test_grouped_gemm_skips_only_the_capability_check_and_stays_on():
    seen, args = _validated(grouped_gemm_without_compute_capability, moe_grouped_gemm=True)
    assert seen["moe_grouped_gemm"] is False and args.moe_grouped_gemm is True
    seen, args = _validated(grouped_gemm_without_compute_capability, moe_grouped_gemm=False)
    assert seen["moe_grouped_gemm"] is False and args.moe_grouped_gemm is False


@pytest.mark.multiproc
@pytest.mark.slow
def test_the_local_spec_checkpoint_has_the_te_spec_keys_and_loads_back():
    result = run_ranks(1, save_and_load_keys, env={"ADAPTER_BACKEND": "cpu"})[0]
    assert result["keys"] == TE_SPEC_KEYS
    assert result["loaded_equal"]


# ---- Megatron-LM's own pretrain_gpt.py (needs the checkout) ----

TINY = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3",
        "--train-iters", "4", "--log-interval", "1", "--seed", "1234", "--mock-data", "--tokenizer-type",
        "NullTokenizer", "--vocab-size", "256", "--normalization", "RMSNorm", "--swiglu",
        "--position-embedding-type", "rope", "--disable-bias-linear", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--eval-iters", "0", "--eval-interval", "1000"]
# examples/mixtral/train_mixtral_8x7b_distributed.sh's MoE flags, tiny, EP2
MIXTRAL_MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-router-load-balancing-type", "aux_loss",
               "--moe-aux-loss-coeff", "1e-2", "--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall",
               "--expert-model-parallel-size", "2"]
# examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh's MoE flags, tiny, EP2 (its flex dispatcher needs DeepEP:
# alltoall here)
DEEPSEEK_V3_MOE = ["--num-experts", "8", "--moe-layer-freq", "[0]+[1]*3", "--moe-ffn-hidden-size", "32",
                   "--moe-shared-expert-intermediate-size", "32", "--moe-router-load-balancing-type", "seq_aux_loss",
                   "--moe-router-topk", "4", "--moe-token-dispatcher-type", "alltoall", "--moe-router-pre-softmax",
                   "--moe-grouped-gemm", "--moe-aux-loss-coeff", "1e-4", "--moe-router-group-topk", "2",
                   "--moe-router-num-groups", "4", "--moe-router-topk-scaling-factor", "2.5",
                   "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                   "--moe-router-bias-update-rate", "1e-3", "--moe-router-dtype", "fp32", "--moe-permute-fusion",
                   "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"]
ALL_MODULES = ["--recompute-granularity", "selective", "--recompute-modules", "core_attn", "mlp", "moe", "moe_act",
               "layernorm", "shared_experts"]


def _flow(workdir, name, args):
    from tests.test_megatron_lm import _losses, _run

    log = _run(workdir, name, 2, TINY + args)
    return log, [float(loss) for _, loss in sorted(_losses(log).items())]


@pytest.fixture(scope="module")
def spellings(tmp_path_factory):
    """Each spelling trains 6 iterations saving at 2; each resumes from the other's checkpoint of 2.
    Megatron-LM logs the mean of the first two iterations after a (re)start as the second, so the resumed
    curve is compared at iterations 5 and 6."""
    from tests.test_megatron_lm import _checkpoint_at

    workdir = tmp_path_factory.mktemp("spellings")
    runs = {}
    for impl in ("transformer_engine", "local"):
        runs[impl] = _flow(workdir, impl, ["--transformer-impl", impl, "--train-iters", "6",
                                           "--save", f"saved-{impl}", "--save-interval", "2"])
    for impl, other in (("local", "transformer_engine"), ("transformer_engine", "local")):
        load = _checkpoint_at(workdir / f"saved-{other}", 2, workdir / f"from-{other}")
        runs[f"{impl}-from-{other}"] = _flow(workdir, f"{impl}-from-{other}",
                                             ["--transformer-impl", impl, "--train-iters", "6", "--load", str(load)])
    return runs


@pytest.mark.megatron_lm
@pytest.mark.multiproc
@pytest.mark.slow
def test_transformer_engine_spelling_trains_the_local_spec_and_says_so_once(spellings):
    log, losses = spellings["transformer_engine"]
    assert log.count("--transformer-impl transformer_engine: Transformer Engine is not importable") == 1
    assert losses == spellings["local"][1] and losses[-1] < losses[0]


@pytest.mark.megatron_lm
@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("resumed", ["local-from-transformer_engine", "transformer_engine-from-local"])
def test_a_checkpoint_saved_under_one_spelling_resumes_exactly_under_the_other(spellings, resumed):
    uninterrupted = spellings["local"][1]
    assert spellings[resumed][1][-2:] == uninterrupted[-2:]


@pytest.mark.megatron_lm
@pytest.mark.multiproc
@pytest.mark.slow
def test_mixtral_moe_flags_with_grouped_gemm_train_at_ep2(tmp_path):
    log, losses = _flow(tmp_path, "mixtral", ["--transformer-impl", "transformer_engine", *MIXTRAL_MOE])
    assert log.count("--moe-grouped-gemm: the experts run the") == 1
    assert len(losses) == 4 and losses[-1] < losses[0]


@pytest.fixture(scope="module")
def deepseek_v3(tmp_path_factory):
    """DeepSeek-V3's MoE flags without recompute, and with every module megatron recomputes without MLA."""
    workdir = tmp_path_factory.mktemp("deepseek-v3")
    return {name: _flow(workdir, name, DEEPSEEK_V3_MOE + extra)[1]
            for name, extra in (("plain", []), ("recompute", ALL_MODULES))}


@pytest.mark.megatron_lm
@pytest.mark.multiproc
@pytest.mark.slow
def test_deepseek_v3_moe_flags_train_at_ep2(deepseek_v3):
    losses = deepseek_v3["plain"]
    assert len(losses) == 4 and losses[-1] < losses[0]


@pytest.mark.megatron_lm
@pytest.mark.multiproc
@pytest.mark.slow
def test_selective_recompute_of_every_module_gives_the_curve_of_no_recompute(deepseek_v3):
    # as logged (7 digits); recomputing shared_experts sums a gradient in another order (test_selective_recompute)
    assert deepseek_v3["recompute"] == pytest.approx(deepseek_v3["plain"], rel=1e-6, abs=0)

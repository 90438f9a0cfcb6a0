"""Megatron-LM's recipes as written (issue 43): ``--transformer-impl transformer_engine`` without Transformer
Engine, ``--moe-grouped-gemm`` off CUDA, selective recompute of every module.

The validate_args wraps are tested here against a stand-in validate_args (Transformer Engine faked importable
and not); the checkpoint keys with megatron-core directly; both run in CI. The tests marked ``megatron_lm``
run Megatron-LM's own pretrain_gpt.py through ``torchrun -m adapter.run`` (tests/test_megatron_lm.py's runner).
"""

from __future__ import annotations

import argparse

import pytest
from megatron.core.extensions import transformer_engine

import adapter  # noqa: F401 - before the patches, as a user script does
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
    monkeypatch.setattr(transformer_engine, "HAVE_TE", False)
    seen, args = _validated(local_spec_without_transformer_engine, transformer_impl=impl)
    assert seen["transformer_impl"] == args.transformer_impl == "local"
    lines = [line for line in capsys.readouterr().out.splitlines() if "--transformer-impl" in line]
    assert len(lines) == (impl == "transformer_engine")


def test_with_transformer_engine_importable_it_stays_transformer_engine(monkeypatch, capsys):
    monkeypatch.setattr(transformer_engine, "HAVE_TE", True)
    seen, args = _validated(local_spec_without_transformer_engine, transformer_impl="transformer_engine")
    assert seen["transformer_impl"] == args.transformer_impl == "transformer_engine"
    assert capsys.readouterr().out == ""


def test_the_line_comes_from_rank_0_only(monkeypatch, capsys):
    monkeypatch.setattr(transformer_engine, "HAVE_TE", False)
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

"""Qwen3.5, Qwen3.5-MoE and Qwen3-Next checkpoints <-> megatron's hybrid layout (models/hf_hybrid.py): tiny
models built by transformers from configs give transformers' logits after conversion at TP1, TP2, TP2 x PP2
and, with experts, EP2 and EP2 x TP2 (real gloo ranks); HF -> mcore -> HF is bit-exact in float32 and bf16; a
multimodal Qwen3.5 converts its language model and says what it leaves; megatron's own TP2 x EP2 save
converts to a HF model with megatron's logits; ``models.verify`` reports within 1e-4."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

import models
from models import hf as hf_format
from models.conversion import ConversionError, hf_to_mcore, mcore_to_hf, read_hf_config
from tests.conversion_ranks import hf_logits_of, megatron_logits_at_layouts, megatron_logits_from, save_like_training
from tests.distributed import ROOT, run_ranks
from tests.hf_models import HYBRID, convert_each, hf_state, save_tiny_hybrid, save_tiny_multimodal
from tests.test_conversion import DENSE_LAYOUTS, MOE_LAYOUTS, _same_on_every_rank
from tests.test_hybrid_models import needs_hybrid, needs_qwen35

pytestmark = [needs_hybrid, needs_qwen35]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Each tiny hybrid HF model, saved and converted once: name -> (hf dir, megatron dir, ModelConfig)."""
    return convert_each(tmp_path_factory, HYBRID, save_tiny_hybrid)


def test_the_tiny_models_cover_what_the_families_vary(converted):
    configs = {name: model for name, (_, _, model) in converted.items()}
    assert all(m.layer_types.count("full_attention") == 1 and m.attention_output_gate and m.zero_centered_norm
               and m.rotary_percent == 0.25 for m in configs.values())
    assert {m.linear_num_value_heads // m.linear_num_key_heads for m in configs.values()} == {2}
    assert {m.tie_embeddings for m in configs.values()} == {True, False}
    assert configs["qwen3-next"].moe_layer_pattern() == (1, 0, 1, 1) and configs["qwen3-next"].moe_router_pre_softmax
    assert all(m.moe_shared_expert_gate for name, m in configs.items() if name != "qwen3.5")


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(HYBRID))
def test_megatron_logits_equal_transformers_at_every_layout(converted, name):
    """One set of HF weights, loaded at each layout (the pattern split over two stages at PP2, Gated DeltaNet's
    heads over two ranks at TP2, the experts at EP2), gives transformers' logits: every layout equals one rank."""
    hf_dir, mcore_dir, model = converted[name]
    layouts = DENSE_LAYOUTS if model.num_experts is None else MOE_LAYOUTS
    per_rank = run_ranks(4, megatron_logits_at_layouts, model, str(mcore_dir), layouts)
    reference = hf_logits_of(str(hf_dir), model.vocab_size)
    for i, layout in enumerate(layouts):
        ours = _same_on_every_rank([logits[i] for logits in per_rank])
        assert (ours - reference).abs().max().item() < 1e-5, f"(TP, PP, EP) = {layout}"


@pytest.mark.parametrize("name", list(HYBRID))
def test_hf_to_mcore_to_hf_is_bit_exact(converted, tmp_path, name):
    hf_dir, mcore_dir, _ = converted[name]
    out = mcore_to_hf(mcore_dir, tmp_path / "hf", progress=False)
    before, after = hf_state(hf_dir), hf_state(out)
    assert sorted(before) == sorted(after)
    assert all(torch.equal(before[key], after[key]) for key in before)
    assert json.loads((out / "config.json").read_text()) == json.loads((hf_dir / "config.json").read_text())


def test_bf16_weights_round_trip_bit_exact(tmp_path):
    """Gated DeltaNet's output norm is stored as gamma by HF and gamma - 1 by megatron: still bit-exact."""
    hf_dir = save_tiny_hybrid("qwen3.5", tmp_path / "hf", dtype=torch.bfloat16)
    hf_to_mcore(hf_dir, tmp_path / "mcore", progress=False)
    before, after = hf_state(hf_dir), hf_state(mcore_to_hf(tmp_path / "mcore", tmp_path / "back", progress=False))
    assert {t.dtype for t in after.values()} == {torch.bfloat16}
    assert all(torch.equal(before[key], after[key]) for key in before)


@pytest.mark.parametrize("name", ["qwen3.5-tiny", "qwen3.5-moe-tiny", "qwen3-next-tiny"])
def test_a_named_model_writes_the_config_json_it_is_read_back_from(name):
    model = models.get(name)
    config = hf_format.config_to_hf(model)
    assert config["architectures"] == [hf_format.architecture_for(model)]
    assert hf_format.config_from_hf(config) == model.replace(seq_length=min(4096, model.max_position_embeddings))


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_multimodal_checkpoint_converts_its_language_model(tmp_path, capfd):
    """Qwen3_5ForConditionalGeneration: the language model converts (one line says the vision tower is left),
    gives the multimodal model's logits on text, and writes back as a Qwen3_5ForCausalLM."""
    import transformers

    hf_dir = save_tiny_multimodal(tmp_path / "hf")
    raw, model = read_hf_config(hf_dir)
    assert raw["architectures"] == ["Qwen3_5ForCausalLM"] and model.layer_types is not None
    hf_to_mcore(hf_dir, tmp_path / "mcore", progress=False)
    assert re.search(r"converting the language model; left the vision tower \(\d+ tensors\)$",
                     capfd.readouterr().err.strip())
    ours = _same_on_every_rank(run_ranks(1, megatron_logits_from, model, str(tmp_path / "mcore"), 1, 1))
    full = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32).eval()
    from tests.conversion_ranks import _tokens

    with torch.no_grad():
        reference = full(input_ids=_tokens(model.vocab_size)).logits
    assert (ours - reference).abs().max().item() < 1e-5
    back = mcore_to_hf(tmp_path / "mcore", tmp_path / "back", progress=False)
    assert json.loads((back / "config.json").read_text())["architectures"] == ["Qwen3_5ForCausalLM"]
    assert (hf_logits_of(str(back), model.vocab_size) - reference).abs().max().item() < 1e-5


@pytest.mark.slow
@pytest.mark.multiproc
def test_checkpoint_saved_at_tp2_ep2_converts_to_hf_with_the_same_logits(tmp_path):
    """qwen3.5-moe-tiny saved by megatron at TP2 x EP2 (Gated DeltaNet's sections split over TP) -> HF from
    the model alone (no config.json of origin) -> transformers gives megatron's logits -> back at TP1."""
    model = models.get("qwen3.5-moe-tiny")
    trained = tmp_path / "trained"
    before = _same_on_every_rank(run_ranks(4, save_like_training, model, str(trained), 2, 1, 100, 2,
                                           dict(moe_grouped_gemm=True, moe_token_dispatcher_type="alltoall")))
    hf_dir = mcore_to_hf(trained, tmp_path / "hf", model=model, progress=False)
    assert json.loads((hf_dir / "config.json").read_text())["architectures"] == ["Qwen3_5MoeForCausalLM"]
    assert (hf_logits_of(str(hf_dir), model.vocab_size) - before).abs().max().item() < 1e-5
    hf_to_mcore(hf_dir, tmp_path / "back", progress=False)
    after = _same_on_every_rank(run_ranks(1, megatron_logits_from, model, str(tmp_path / "back"), 1, 1))
    assert (after - before).abs().max().item() < 1e-5


@pytest.mark.slow
@pytest.mark.multiproc
def test_verify_command_reports_within_1e_4(converted):
    """The verify command on the MoE hybrid at EP2. Once: each hybrid's logits at TP2, PP2 and EP2 are the test
    above's, and the command's own path the same for both (the suite ran it for qwen3.5 at TP2 too, 76 s)."""
    hf_dir, _, _ = converted["qwen3-next"]
    done = subprocess.run([sys.executable, "-m", "models.verify", "--hf-dir", str(hf_dir), "--ep", "2"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    line = next(line for line in done.stdout.splitlines() if line.startswith("max |logit difference|"))
    assert float(line.split()[3]) < 1e-4 and line.endswith("OK")


def test_a_layout_that_splits_a_gated_delta_net_head_is_refused_by_the_converter_and_the_flow(monkeypatch):
    model = models.get("qwen3.5-tiny", num_attention_heads=8, num_query_groups=4, kv_channels=16)
    model.check_layout(tp=2)
    with pytest.raises(models.ModelConfigError, match="tensor parallel size 4 does not divide Gated DeltaNet's "
                                                      "linear_num_key_heads=2: choose"):
        model.check_layout(tp=4)
    with pytest.raises(models.ModelConfigError, match="tensor parallel size 2 x context parallel size 2 does not "
                                                      "divide Gated DeltaNet's linear_num_key_heads=2: choose"):
        model.check_layout(tp=2, cp=2)
    assert _flow_refusal(monkeypatch, [
        "--model", "qwen3.5-tiny", "--tensor-model-parallel-size", "2", "--context-parallel-size", "2",
        "--attention-dropout", "0", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-4", "--mock-data",
        "--eval-interval", "1", "--eval-iters", "1"], 4) == (
        "--model qwen3.5-tiny: tensor parallel size 2 x context parallel size 2 does not divide Gated DeltaNet's "
        "linear_num_key_heads=2: choose sizes whose product divides them")


def _flow_refusal(monkeypatch, argv: list[str], world: int) -> str:
    """The one line the flow (scripts/pretrain_gpt.py: megatron.training's parser with the adapter's patches,
    then flow/hybrid.py's builder inputs) refuses hybrid ``argv`` with at ``world`` ranks, as rank 0."""
    from megatron.core import num_microbatches_calculator
    from megatron.training import global_vars
    from megatron.training.arguments import parse_and_validate_args

    from adapter.input_refusals import InputRefused
    from flow import hybrid, model_flags, releases

    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # validate_args sets it off CUDA
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *model_flags.expand(argv)])
    try:
        with pytest.raises(InputRefused) as refused:
            hybrid.pretrain_inputs(parse_and_validate_args(args_defaults=releases.ARGS_DEFAULTS),
                                   model_flags.name(argv))
    finally:
        global_vars.unset_global_variables()
        num_microbatches_calculator.unset_num_microbatches_calculator()
    return str(refused.value)


def test_weights_that_disagree_with_layer_types_are_refused(converted, tmp_path):
    """A config.json whose layer_types put attention where the weights hold a Gated DeltaNet."""
    hf_dir, _, _ = converted["qwen3.5"]
    copy = tmp_path / "hf"
    copy.mkdir()
    for file in hf_dir.iterdir():
        (copy / file.name).write_bytes(file.read_bytes())
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "layer_types": ["full_attention"] * 4}))
    with pytest.raises(ConversionError, match=r"lacks \d+ tensor\(s\) its config.json implies, e.g. "
                                              r"model.layers.0.self_attn"):
        hf_to_mcore(copy, tmp_path / "x", progress=False)


def test_a_multimodal_config_ties_the_output_layer_by_its_outer_flag():
    """transformers ties Qwen3_5ForConditionalGeneration's output layer by the outer config's
    tie_word_embeddings (its text_config's may say otherwise)."""
    from models.hf_hybrid import language_model_config

    text = {"model_type": "qwen3_5_text", "tie_word_embeddings": False}
    outer = {"architectures": ["Qwen3_5ForConditionalGeneration"], "tie_word_embeddings": True, "text_config": text}
    assert language_model_config(outer) == {**text, "tie_word_embeddings": True,
                                            "architectures": ["Qwen3_5ForCausalLM"]}
    assert language_model_config({**outer, "tie_word_embeddings": False})["tie_word_embeddings"] is False

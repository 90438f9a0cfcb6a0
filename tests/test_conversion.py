"""Hugging Face <-> megatron conversion: logits after conversion equal HF's at TP1, TP2 and TP2 x PP2
(real gloo ranks; Qwen3-MoE also at EP2 and EP2 x TP2), HF -> mcore -> HF is bit-exact, checkpoints megatron
saved at TP2 x PP2 and at EP2 x TP2 come back at TP1, and bad input is one clear error that leaves nothing
half-written."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

import models
from adapter import checkpoint_dir
from models import torch_dist_io
from models.conversion import ConversionError, hf_to_mcore, mcore_to_hf, read_hf_config
from tests.conversion_ranks import (hf_logits_of, megatron_logits_at_layouts, megatron_logits_from,
                                    save_like_training)
from tests.distributed import ROOT, run_ranks
from tests.hf_models import TINY, TOKENIZER_CONFIG, convert_each, hf_state, save_tiny

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Each tiny HF model, saved and converted once: name -> (hf dir, megatron dir, ModelConfig)."""
    return convert_each(tmp_path_factory, TINY, save_tiny)


def _same_on_every_rank(results: list) -> torch.Tensor:
    """The last stage's logits, which every rank there computed: equal to rounding (with EP a rank's
    tokens meet other ranks' in its experts' GEMMs, whose blocking may differ)."""
    present = [r for r in results if r is not None]
    assert present, "no rank returned logits"
    for other in present[1:]:
        torch.testing.assert_close(other, present[0], rtol=0, atol=1e-6)
    return present[0]


# (TP, PP, EP) on four ranks (the rest data parallel); EP needs experts
DENSE_LAYOUTS = [(1, 1, 1), (2, 1, 1), (2, 2, 1)]
MOE_LAYOUTS = DENSE_LAYOUTS + [(1, 1, 2), (2, 1, 2)]


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(TINY))
def test_megatron_logits_equal_transformers_at_every_layout(converted, name):
    """Every tiny model (Qwen2 with QKV bias, Llama, Qwen3 with heads of their own size and QK-norm, GQA 1:1
    to 8:1, tied and untied; Qwen3-MoE with 4 and 6 experts, renormalised or not, one dense layer among the
    sparse ones) loaded at each layout gives transformers' logits."""
    hf_dir, mcore_dir, model = converted[name]
    layouts = DENSE_LAYOUTS if model.num_experts is None else MOE_LAYOUTS
    per_rank = run_ranks(4, megatron_logits_at_layouts, model, str(mcore_dir), layouts)
    reference = hf_logits_of(str(hf_dir), model.vocab_size)
    assert reference.shape == (2, 24, 512)
    for i, layout in enumerate(layouts):
        ours = _same_on_every_rank([logits[i] for logits in per_rank])
        assert (ours - reference).abs().max().item() < 1e-5, f"(TP, PP, EP) = {layout}"


def test_the_tiny_models_cover_what_qwen3_varies(converted):
    models_ = {name: model for name, (_, _, model) in converted.items() if name.startswith("qwen3")}
    assert all(m.head_dim * m.num_attention_heads != m.hidden_size and m.qk_layernorm for m in models_.values())
    assert {m.num_attention_heads // m.num_query_groups for m in models_.values()} >= {1, 4}
    assert {m.tie_embeddings for m in models_.values()} == {True, False}
    moe = [m for m in models_.values() if m.num_experts]
    assert min(m.num_experts for m in moe) >= 4 and {m.moe_router_pre_softmax for m in moe} == {True, False}
    assert any(0 in m.moe_layer_pattern() for m in moe)


@pytest.mark.parametrize("name", list(TINY))
def test_hf_to_mcore_to_hf_is_bit_exact(converted, tmp_path, name):
    hf_dir, mcore_dir, _ = converted[name]
    out = mcore_to_hf(mcore_dir, tmp_path / "hf", progress=False)
    before, after = hf_state(hf_dir), hf_state(out)
    assert sorted(before) == sorted(after)
    for key in before:
        assert before[key].dtype == after[key].dtype, key
        assert torch.equal(before[key], after[key]), key
    assert json.loads((out / "config.json").read_text()) == json.loads((hf_dir / "config.json").read_text())
    assert json.loads((out / "tokenizer_config.json").read_text()) == TOKENIZER_CONFIG


@pytest.mark.parametrize("name", ["qwen-gqa2-untied", "qwen3-gqa4-untied", "qwen3-moe-dense-layer"])
def test_bf16_weights_round_trip_bit_exact_and_cast_on_request(tmp_path, name):
    hf_dir = save_tiny(name, tmp_path / "hf", dtype=torch.bfloat16)
    hf_to_mcore(hf_dir, tmp_path / "mcore", progress=False)
    metadata = torch_dist_io.tensors_metadata(checkpoint_dir.iteration_dir(tmp_path / "mcore"))
    assert {m.dtype for m in metadata.values()} == {torch.bfloat16}
    back = hf_state(mcore_to_hf(tmp_path / "mcore", tmp_path / "back", progress=False))
    assert all(torch.equal(t, back[k]) for k, t in hf_state(hf_dir).items())
    fp32 = mcore_to_hf(tmp_path / "mcore", tmp_path / "fp32", dtype="fp32", progress=False)
    assert {t.dtype for t in hf_state(fp32).values()} == {torch.float32}
    assert json.loads((fp32 / "config.json").read_text())["torch_dtype"] == "float32"


def test_output_is_split_into_safetensors_shards_with_an_index(converted, tmp_path):
    hf_dir, mcore_dir, _ = converted["qwen-gqa2-untied"]
    out = mcore_to_hf(mcore_dir, tmp_path / "hf", max_shard_bytes=200_000, progress=False)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 3 and files == sorted(p.name for p in out.glob("*.safetensors"))
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in hf_state(out).values())
    assert sorted(hf_state(out)) == sorted(hf_state(hf_dir))


@pytest.mark.slow
@pytest.mark.multiproc
def test_checkpoint_saved_at_tp2_pp2_converts_to_hf_and_back_to_tp1(tmp_path):
    """megatron's own TP2 x PP2 save -> HF -> megatron at TP1: the same logits on both layouts and in HF."""
    model = models.get("qwen2.5-tiny")
    trained = tmp_path / "trained"
    before = _same_on_every_rank(run_ranks(4, save_like_training, model, str(trained), 2, 2))
    with pytest.raises(ConversionError, match="does not say which model it holds.*pass --model NAME"):
        mcore_to_hf(trained, tmp_path / "unknown", progress=False)
    hf_dir = mcore_to_hf(trained, tmp_path / "hf", model=model, progress=False)
    assert json.loads((hf_dir / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    hf_to_mcore(hf_dir, tmp_path / "back", progress=False)
    _assert_laid_out_as_megatron_saves(checkpoint_dir.iteration_dir(tmp_path / "back"),
                                       checkpoint_dir.iteration_dir(trained))
    after = _same_on_every_rank(run_ranks(1, megatron_logits_from, model, str(tmp_path / "back"), 1, 1))
    assert (after - before).abs().max().item() < 1e-5
    assert (hf_logits_of(str(hf_dir), model.vocab_size) - before).abs().max().item() < 1e-5


def _assert_laid_out_as_megatron_saves(converted, saved) -> None:
    """The converter's checkpoint keeps its common state where the installed megatron-core's own save put
    ``saved``'s (common.pt before 0.19, inside the torch_dist files from 0.19), with the same metadata.json,
    and megatron's reader finds it there."""
    assert (converted / "common.pt").is_file() == (saved / "common.pt").is_file()
    assert json.loads((converted / "metadata.json").read_text()) == json.loads((saved / "metadata.json").read_text())
    assert checkpoint_dir.read_common(converted)["hf_architecture"] == "Qwen2ForCausalLM"


@pytest.mark.slow
@pytest.mark.multiproc
def test_checkpoint_saved_at_ep2_tp2_converts_to_hf_with_the_same_logits(tmp_path):
    """Qwen3-MoE saved by megatron at EP2 x TP2 with the flow's grouped experts and all-to-all dispatcher:
    written as HF (config.json built from the model, no original one), its logits equal megatron's in
    transformers and back in megatron at TP1."""
    model = models.get("qwen3-moe-tiny")
    trained = tmp_path / "trained"
    before = _same_on_every_rank(run_ranks(4, save_like_training, model, str(trained), 2, 1, 100, 2,
                                           dict(moe_grouped_gemm=True, moe_token_dispatcher_type="alltoall")))
    hf_dir = mcore_to_hf(trained, tmp_path / "hf", model=model, progress=False)
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["head_dim"] == 32
    assert read_hf_config(hf_dir)[1].replace(seq_length=model.seq_length) == model  # a launch default, not HF's
    assert (hf_logits_of(str(hf_dir), model.vocab_size) - before).abs().max().item() < 1e-5
    hf_to_mcore(hf_dir, tmp_path / "back", progress=False)
    after = _same_on_every_rank(run_ranks(1, megatron_logits_from, model, str(tmp_path / "back"), 1, 1))
    assert (after - before).abs().max().item() < 1e-5


@pytest.mark.slow
@pytest.mark.multiproc
def test_verify_command_reports_the_difference_and_exits_zero(converted):
    hf_dir, mcore_dir, _ = converted["qwen3-moe"]
    done = subprocess.run([sys.executable, "-m", "models.verify", "--hf-dir", str(hf_dir), "--load",
                           str(mcore_dir), "--ep", "2", "--atol", "1e-5"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("max |logit difference|")]
    assert len(lines) == 1 and "(TP 1, PP 1, EP 2;" in lines[0], done.stdout  # one report, not one per DP rank
    assert float(lines[0].split()[3]) < 1e-5 and lines[0].endswith("OK")


@pytest.mark.slow
def test_verify_command_refuses_expert_parallelism_for_a_dense_model(converted):
    hf_dir, _, _ = converted["qwen3-gqa1-tied"]
    done = subprocess.run([sys.executable, "-m", "models.verify", "--hf-dir", str(hf_dir), "--ep", "2"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "expert parallel size 2 for a dense model" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.slow
def test_verify_command_converts_by_itself_and_fails_on_a_tolerance_it_misses(converted):
    hf_dir, _, _ = converted["qwen-gqa8-tied"]
    done = subprocess.run([sys.executable, "-m", "models.verify", "--hf-dir", str(hf_dir), "--atol", "0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "MISMATCH" in done.stdout


# --- bad input -------------------------------------------------------------------------------------------

def _edit_config(hf_dir, **changes):
    path = hf_dir / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.fixture
def hf_copy(tmp_path):
    return save_tiny("qwen-gqa2-untied", tmp_path / "hf")


@pytest.mark.parametrize("break_it, message", [
    (lambda d: (d / "config.json").unlink(), "has no config.json"),
    (lambda d: (d / "model.safetensors").unlink(), "has no model.safetensors"),
    (lambda d: _edit_config(d, intermediate_size=200), "config.json implies (200, 64)"),
    (lambda d: _edit_config(d, num_hidden_layers=5), "lacks 12 tensor(s)"),
    (lambda d: _edit_config(d, architectures=["GPT2LMHeadModel"]), "'GPT2LMHeadModel'"),
    (lambda d: _edit_config(d, rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope scaling 'yarn'"),
    (lambda d: _edit_config(d, use_sliding_window=True), "use_sliding_window"),
], ids=["no-config", "no-weights", "shape-mismatch", "missing-tensors", "architecture", "rope-scaling",
        "sliding-window"])
def test_bad_hf_input_is_one_clear_error_and_writes_nothing(hf_copy, tmp_path, break_it, message):
    break_it(hf_copy)
    with pytest.raises(ConversionError, match=re.escape(message)):
        hf_to_mcore(hf_copy, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def _fuse_experts(hf_dir):
    """The experts as transformers 5 holds them in memory (one gate_up and one down tensor per layer), not
    as checkpoints on the hub and save_pretrained store them (one tensor per expert)."""
    from safetensors.torch import save_file

    state = hf_state(hf_dir)
    for layer in range(4):
        names = [f"model.layers.{layer}.mlp.experts.{e}." for e in range(4)]
        gate_up = [torch.cat([state.pop(n + "gate_proj.weight"), state.pop(n + "up_proj.weight")]) for n in names]
        state[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.stack(gate_up)
        state[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.stack([state.pop(n + "down_proj.weight")
                                                                           for n in names])
    save_file(state, hf_dir / "model.safetensors")


@pytest.mark.parametrize("break_it, message", [
    (lambda d: _edit_config(d, attention_bias=True), "Qwen3MoeForCausalLM with attention_bias"),
    (lambda d: _edit_config(d, num_experts=None, num_local_experts=None), "without num_experts"),
    (lambda d: _edit_config(d, num_experts_per_tok=5), "moe_router_topk=5 exceeds num_experts=4"),
    (lambda d: _edit_config(d, head_dim=20), "config.json implies (160, 64)"),
    (_fuse_experts, "holds each layer's experts fused (model.layers.0.mlp.experts.gate_up_proj), not one"),
], ids=["attention-bias", "no-experts", "topk", "head-dim", "fused-experts"])
def test_bad_qwen3_moe_input_is_one_clear_error(tmp_path, break_it, message):
    hf_dir = save_tiny("qwen3-moe", tmp_path / "hf")
    break_it(hf_dir)
    with pytest.raises(ConversionError, match=re.escape(message)):
        hf_to_mcore(hf_dir, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_ep_that_does_not_divide_the_experts_is_refused(tmp_path):
    hf_dir = save_tiny("qwen3-moe", tmp_path / "hf")
    with pytest.raises(ConversionError, match="expert parallel size 3 does not divide num_experts=4"):
        hf_to_mcore(hf_dir, tmp_path / "out", ep=3, progress=False)


def test_tp_that_does_not_divide_the_heads_is_refused(hf_copy, tmp_path):
    with pytest.raises(ConversionError, match="tensor parallel size 3 does not divide num_attention_heads=4"):
        hf_to_mcore(hf_copy, tmp_path / "out", tp=3, progress=False)
    with pytest.raises(ConversionError, match=r"4 layers cannot be split evenly over pipeline \(3\)"):
        hf_to_mcore(hf_copy, tmp_path / "out", pp=3, progress=False)


def test_a_failure_mid_write_leaves_no_checkpoint_behind(hf_copy, tmp_path, monkeypatch):
    from models import conversion

    reads = []

    def failing_get(self, name):
        reads.append(name)
        if len(reads) == 6:
            raise OSError("disk went away")
        return original(self, name)

    original = conversion.HFWeights.get
    monkeypatch.setattr(conversion.HFWeights, "get", failing_get)
    with pytest.raises(OSError, match="disk went away"):
        hf_to_mcore(hf_copy, tmp_path / "out", progress=False)
    assert not (tmp_path / "out" / "release").exists()
    assert not (tmp_path / "out" / checkpoint_dir.TRACKER).exists()
    assert not [p for p in (tmp_path / "out").iterdir() if "partial" in p.name]


def test_existing_checkpoint_and_non_empty_output_are_refused(converted, tmp_path):
    hf_dir, mcore_dir, _ = converted["qwen-gqa2-untied"]
    with pytest.raises(ConversionError, match="already holds a checkpoint"):
        hf_to_mcore(hf_dir, mcore_dir, progress=False)
    with pytest.raises(ConversionError, match="is not empty"):
        mcore_to_hf(mcore_dir, hf_dir, progress=False)
    with pytest.raises(ConversionError, match="holds no megatron checkpoint"):
        mcore_to_hf(tmp_path, tmp_path / "x", progress=False)


def test_wrong_model_for_a_checkpoint_is_refused(converted, tmp_path):
    _, mcore_dir, _ = converted["qwen-gqa2-untied"]
    with pytest.raises(ConversionError, match="the model implies"):
        mcore_to_hf(mcore_dir, tmp_path / "x", model=models.get("qwen2.5-tiny", num_query_groups=4),
                    progress=False)


def test_cli_prints_one_error_line_not_a_traceback(hf_copy, tmp_path):
    done = subprocess.run([sys.executable, "scripts/convert_checkpoint.py", "hf-to-mcore", "--hf-dir",
                           str(hf_copy), "--save-dir", str(tmp_path / "out"), "--tp", "3"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("error: tensor parallel size 3 does not divide")

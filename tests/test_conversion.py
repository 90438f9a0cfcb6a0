"""Hugging Face <-> megatron conversion: logits after conversion equal HF's at TP1, TP2 and TP2 x PP2
(real gloo ranks), HF -> mcore -> HF is bit-exact, a checkpoint megatron saved at TP2 x PP2 comes back at
TP1, and bad input is one clear error that leaves nothing half-written."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

import models
from models import checkpoint as mcore
from models.conversion import ConversionError, hf_to_mcore, mcore_to_hf, read_hf_config
from tests.conversion_ranks import hf_logits_of, megatron_logits_from, save_like_training
from tests.distributed import ROOT, run_ranks
from tests.hf_models import TINY, TOKENIZER_CONFIG, hf_state, save_tiny

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Each tiny HF model, saved and converted once: name -> (hf dir, megatron dir, ModelConfig)."""
    out = {}
    for name in TINY:
        root = tmp_path_factory.mktemp(name)
        hf_dir = save_tiny(name, root / "hf")
        hf_to_mcore(hf_dir, root / "mcore", tp=2, pp=2, progress=False)
        out[name] = (hf_dir, root / "mcore", read_hf_config(hf_dir)[1])
    return out


def _last_stage_logits(results: list) -> torch.Tensor:
    present = [r for r in results if r is not None]
    assert present, "no rank returned logits"
    for other in present[1:]:  # every TP rank of the last stage holds the same gathered logits
        assert torch.equal(other, present[0])
    return present[0]


LAYOUTS = {"tp1": (1, 1), "tp2": (2, 1), "tp2-pp2": (2, 2)}


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", ["qwen-gqa2-untied", "qwen-gqa8-tied"])
def test_megatron_logits_equal_hf_after_conversion(converted, name, layout):
    hf_dir, mcore_dir, model = converted[name]
    tp, pp = LAYOUTS[layout]
    ours = _last_stage_logits(run_ranks(tp * pp, megatron_logits_from, model, str(mcore_dir), tp, pp))
    reference = hf_logits_of(str(hf_dir), model.vocab_size)
    assert ours.shape == reference.shape == (2, 24, 512)
    assert (ours - reference).abs().max().item() < 1e-5


@pytest.mark.slow
@pytest.mark.multiproc
def test_llama_logits_equal_hf_after_conversion_at_tp2(converted):
    hf_dir, mcore_dir, model = converted["llama-gqa2"]
    assert not model.add_qkv_bias
    ours = _last_stage_logits(run_ranks(2, megatron_logits_from, model, str(mcore_dir), 2, 1))
    assert (ours - hf_logits_of(str(hf_dir), model.vocab_size)).abs().max().item() < 1e-5


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


def test_bf16_weights_round_trip_bit_exact_and_cast_on_request(tmp_path):
    hf_dir = save_tiny("qwen-gqa2-untied", tmp_path / "hf", dtype=torch.bfloat16)
    hf_to_mcore(hf_dir, tmp_path / "mcore", progress=False)
    metadata = mcore.tensors_metadata(mcore.iteration_dir(tmp_path / "mcore"))
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
    before = _last_stage_logits(run_ranks(4, save_like_training, model, str(trained), 2, 2))
    with pytest.raises(ConversionError, match="does not say which model it holds.*pass --model NAME"):
        mcore_to_hf(trained, tmp_path / "unknown", progress=False)
    hf_dir = mcore_to_hf(trained, tmp_path / "hf", model=model, progress=False)
    assert json.loads((hf_dir / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    hf_to_mcore(hf_dir, tmp_path / "back", progress=False)
    after = _last_stage_logits(run_ranks(1, megatron_logits_from, model, str(tmp_path / "back"), 1, 1))
    assert (after - before).abs().max().item() < 1e-5
    assert (hf_logits_of(str(hf_dir), model.vocab_size) - before).abs().max().item() < 1e-5


@pytest.mark.slow
@pytest.mark.multiproc
def test_verify_command_reports_the_difference_and_exits_zero(converted):
    hf_dir, mcore_dir, _ = converted["qwen-gqa2-untied"]
    done = subprocess.run([sys.executable, "-m", "models.verify", "--hf-dir", str(hf_dir), "--load",
                           str(mcore_dir), "--tp", "2", "--atol", "1e-5"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    line = next(line for line in done.stdout.splitlines() if line.startswith("max |logit difference|"))
    assert float(line.split()[3]) < 1e-5 and line.endswith("OK")


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


def test_tp_that_does_not_divide_the_heads_is_refused(hf_copy, tmp_path):
    with pytest.raises(ConversionError, match="tensor parallel size 3 does not divide num_attention_heads=4"):
        hf_to_mcore(hf_copy, tmp_path / "out", tp=3, progress=False)
    with pytest.raises(ConversionError, match="4 layers cannot be split evenly into 3 pipeline stages"):
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
    assert not (tmp_path / "out" / mcore.TRACKER).exists()
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

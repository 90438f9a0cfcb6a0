"""DeepSeek-V3's published weights are FP8 (e4m3) with a float32 scale per 128 x 128 block
(``weight_scale_inv``): the converter reads them as bf16 (models/fp8_blocks.py). Held to the definition,
value x its block's scale, indexed element by element here, and end to end: a tiny model quantized as
DeepSeek quantizes converts to the checkpoint of its dequantized bf16 copy."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import save_file

from models.conversion import ConversionError, HFWeights, hf_to_mcore, mcore_to_hf
from tests.hf_models import hf_state, save_tiny

FP8_MAX = 448.0  # e4m3's largest finite value


def quantize(weight: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's block quantization: per block, scale = amax / 448, stored value = weight / scale."""
    rows, cols = weight.shape
    scales = torch.empty(-(-rows // block), -(-cols // block))
    values = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            tile = weight[i * block:(i + 1) * block, j * block:(j + 1) * block].float()
            scales[i, j] = tile.abs().max().clamp(min=1e-12) / FP8_MAX
            values[i * block:(i + 1) * block, j * block:(j + 1) * block] = (tile / scales[i, j]).to(values.dtype)
    return values, scales


def by_element(values: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    rows = torch.arange(values.shape[0]) // block
    cols = torch.arange(values.shape[1]) // block
    return (values.float() * scales[rows][:, cols]).to(torch.bfloat16)


def test_rows_of_an_fp8_weight_read_as_value_times_their_blocks_scale(tmp_path):
    torch.manual_seed(0)
    values, scales = quantize(torch.randn(300, 200), 128)  # partial last blocks on both sides
    save_file({"w.weight": values, "w.weight_scale_inv": scales, "n.weight": torch.ones(200)},
              tmp_path / "model.safetensors")
    weights = HFWeights(tmp_path)
    assert set(weights.shape) == {"w.weight", "n.weight"} and weights.dtype["w.weight"] == torch.bfloat16
    expected = by_element(values, scales, 128)
    assert torch.equal(weights.get("w.weight"), expected)
    assert torch.equal(weights.get_rows("w.weight", 100, 250), expected[100:250])
    assert torch.equal(weights.get_rows("w.weight", 129, 130), expected[129:130])
    assert "dequantized 1 FP8 (e4m3) weights with their 128x128 block scales" in weights.dequantized_line()


def _quantized_copies(tmp_path, block: int):
    """A tiny Qwen3 with its projections quantized as DeepSeek's are (embeddings, norms and the output layer
    stay bf16), and the bf16 model those FP8 weights stand for."""
    source = save_tiny("qwen3-gqa4-untied", tmp_path / "source", dtype=torch.bfloat16)
    config = json.loads((source / "config.json").read_text())
    fp8, dequantized = {}, {}
    for name, tensor in hf_state(source).items():
        if tensor.dim() == 2 and "_proj." in name:
            values, scales = quantize(tensor, block)
            fp8[name], fp8[name + "_scale_inv"] = values, scales
            dequantized[name] = by_element(values, scales, block)
        else:
            fp8[name] = dequantized[name] = tensor
    for directory, state, extra in ((tmp_path / "fp8", fp8, {"quantization_config": {
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [block, block]}}), (tmp_path / "bf16", dequantized, {})):
        directory.mkdir()
        save_file(state, directory / "model.safetensors")
        (directory / "config.json").write_text(json.dumps({**config, **extra}))
    return tmp_path / "fp8", tmp_path / "bf16"


def test_an_fp8_checkpoint_converts_to_the_checkpoint_of_its_dequantized_weights(tmp_path, capsys):
    fp8, bf16 = _quantized_copies(tmp_path, block=32)
    for source in (fp8, bf16):
        hf_to_mcore(source, tmp_path / f"{source.name}-mcore", tp=2, progress=False)
        mcore_to_hf(tmp_path / f"{source.name}-mcore", tmp_path / f"{source.name}-back", progress=False)
    assert re.search(r"dequantized \d+ FP8 \(e4m3\) weights with their 32x32 block scales \(weight_scale_inv\) "
                     r"to bf16", capsys.readouterr().err)
    back, reference = hf_state(tmp_path / "fp8-back"), hf_state(tmp_path / "bf16-back")
    assert back.keys() == reference.keys() and all(back[k].dtype == torch.bfloat16 for k in back)
    assert all(torch.equal(back[k], reference[k]) for k in back)


def test_an_fp8_weight_without_its_block_scales_is_one_clear_error(tmp_path):
    fp8, _ = _quantized_copies(tmp_path, block=32)
    state = hf_state(fp8)
    del state["model.layers.0.self_attn.q_proj.weight_scale_inv"]
    save_file(state, fp8 / "model.safetensors")
    with pytest.raises(ConversionError, match=re.escape("model.layers.0.self_attn.q_proj.weight is FP8 (192, 64) "
                                                        "but model.layers.0.self_attn.q_proj.weight_scale_inv is "
                                                        "missing")):
        hf_to_mcore(fp8, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()

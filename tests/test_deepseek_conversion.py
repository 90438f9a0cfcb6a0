"""DeepSeek-V3 / Kimi-K2 checkpoints (``DeepseekV3ForCausalLM``) <-> megatron's MLA layout (models/hf_deepseek.py):
tiny models built by transformers from configs give transformers' logits after conversion at TP1, TP2, TP2 x
PP2, EP2 and EP2 x TP2 (real gloo ranks), with YaRN over sequences longer than its original positions and a
non-zero expert bias; the MTP layer (which transformers' model does not run) round-trips bit-exactly and its
output equals an independent torch reference of DeepSeek-V3's MTP; HF -> mcore -> HF is bit-exact in float32
and bf16; FP8 block-quantized weights convert as their bf16 dequantization; config.json <-> ModelConfig both
ways for the published DeepSeek-V3 and Kimi-K2 configs; what megatron cannot express is refused by name."""

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
from models import hf as hf_format
from models.conversion import ConversionError, hf_to_mcore, mcore_to_hf, read_hf_config
from tests.conversion_ranks import _tokens, hf_logits_of, megatron_logits_at_layouts
from tests.deepseek_models import DEEPSEEK, mtp_reference_logits, save_tiny_deepseek
from tests.distributed import ROOT, run_ranks
from tests.hf_models import convert_each, hf_state
from tests.test_conversion import MOE_LAYOUTS, _same_on_every_rank

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Each tiny DeepSeek-V3, saved and converted once: name -> (hf dir, megatron dir, ModelConfig)."""
    return convert_each(tmp_path_factory, DEEPSEEK, save_tiny_deepseek)


def test_the_tiny_models_cover_what_deepseek_varies(converted):
    configs = {name: model for name, (_, _, model) in converted.items()}
    assert {m.moe_layer_pattern().index(1) for m in configs.values()} == {1, 2}  # dense-first 1 and 2
    assert {m.tie_embeddings for m in configs.values()} == {True, False}
    grouped = configs["dsv3-qlora-yarn-mtp"]
    assert grouped.moe_router_num_groups == 4 and grouped.moe_router_group_topk == 2 and grouped.mtp_num_layers == 1
    assert grouped.rotary_scaling_factor == 4 and grouped.original_max_position_embeddings < _tokens(96).shape[1]
    assert grouped.mscale != grouped.mscale_all_dim
    assert all(m.multi_latent_attention and m.qk_layernorm and m.moe_router_enable_expert_bias
               for m in configs.values())
    assert {m.q_lora_rank is None for m in configs.values()} == {True, False}
    biases = [t for name, t in hf_state(converted["dsv3-dense2-tied"][0]).items() if "e_score_correction_bias" in name]
    assert biases and all(t.abs().min() > 0 for t in biases)


# The model without a query LoRA differs in its query projection alone: TP1 and TP2 (its column split), on 2 ranks.
LAYOUTS = {"dsv2lite-no-qlora": [(1, 1, 1), (2, 1, 1)]}


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(DEEPSEEK))
def test_megatron_logits_equal_transformers_at_every_layout(converted, name):
    """transformers' DeepseekV3ForCausalLM (its interleaved RoPE pairs, YaRN with mscale over 24 positions of 16
    original ones, sigmoid routing with bias and groups, shared experts, dense-first layers; without a query LoRA,
    q_proj on the normed hidden state and no other norm before it) and megatron's MLA loaded from the converted
    checkpoint at each layout give the same logits."""
    hf_dir, mcore_dir, model = converted[name]
    layouts = LAYOUTS.get(name, MOE_LAYOUTS)
    per_rank = run_ranks(max(tp * pp * ep for tp, pp, ep in layouts), megatron_logits_at_layouts, model,
                         str(mcore_dir), layouts)
    reference = hf_logits_of(str(hf_dir), model.vocab_size)
    for i, layout in enumerate(layouts):
        ours = _same_on_every_rank([logits[i] for logits in per_rank])
        assert (ours - reference).abs().max().item() < 1e-5, f"(TP, PP, EP) = {layout}"
    if model.rotary_scaling_factor > 1:  # and the bound is sharp: transformers' other RoPE layout, or YaRN without
        for change in (dict(rope_interleave=False),  # its attention factor, give other logits
                       dict(rope_parameters={**json.loads((hf_dir / "config.json").read_text())["rope_parameters"],
                                             "mscale": 1.0})):
            other = _edited_copy(hf_dir, mcore_dir.parent / "variant", **change)
            assert (hf_logits_of(str(other), model.vocab_size) - reference).abs().max().item() > 1e-4, change


def _edited_copy(hf_dir, directory, **changes):
    import shutil

    shutil.rmtree(directory, ignore_errors=True)
    shutil.copytree(hf_dir, directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **changes}))
    return directory


def megatron_mtp_logits(model, load_dir: str):
    """The logits of megatron's MTP layer 0 at TP1 (its output through the shared output layer), [batch, seq, vocab];
    positions whose next token megatron fills in (the last) included."""
    from tests.conversion_ranks import _finish, _model
    from models.torch_dist_io import load_model_weights

    chunks = _model(model, 1, 1)
    load_model_weights(chunks, load_dir)
    gpt, captured = chunks[0], {}
    gpt.mtp.layers[0].register_forward_hook(lambda module, args, output: captured.update(hidden=output[0]))
    tokens = _tokens(model.vocab_size)
    with torch.no_grad():
        gpt(tokens, torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens), None)
        logits, _ = gpt.output_layer(captured["hidden"])
    _finish()
    return logits.transpose(0, 1).float()


@pytest.mark.slow
@pytest.mark.multiproc
def test_the_mtp_layer_gives_deepseeks_mtp_output(converted):
    """megatron's MTP layer, loaded from the converted model.layers.<N>.* tensors, equals DeepSeek-V3's MTP computed
    in plain torch from those tensors: the next token's embedding and the main model's output hidden state, each
    normed, concatenated in that order, projected, one decoder block, the shared head's norm and the output head."""
    hf_dir, mcore_dir, model = converted["dsv3-qlora-yarn-mtp"]
    ours = run_ranks(1, megatron_mtp_logits, model, str(mcore_dir))[0]
    reference = mtp_reference_logits(str(hf_dir), _tokens(model.vocab_size))
    assert reference.shape == (2, 23, 96)
    assert (ours[:, :-1] - reference).abs().max().item() < 1e-5
    # the reference is sharp: the main model's logits differ from the MTP layer's
    assert (hf_logits_of(str(hf_dir), model.vocab_size)[:, :-1] - reference).abs().max().item() > 1e-2


def test_the_mtp_model_gives_transformers_logits_in_this_process(tmp_path):
    """deepseek-v3-tiny's features (MLA with a query LoRA, YaRN, grouped sigmoid routing with bias, shared experts, an
    MTP layer) in this process at TP1, from a checkpoint converted at TP1: a forward without labels gives
    transformers' logits. CI's one MLA + MTP test on megatron-core 0.16.1, whose MLA took Transformer Engine's
    stand-in for TE and whose MTP loss asked for labels (patches/latent_attention.py, multi_token_prediction.py)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from models.provider import make_model_provider
    from models.verify import megatron_logits

    hf_dir = save_tiny_deepseek("dsv3-qlora-yarn-mtp", tmp_path / "hf")
    hf_to_mcore(hf_dir, tmp_path / "mcore", progress=False)
    model = read_hf_config(hf_dir)[1]
    with torch_dist_io.single_process_groups():
        model_parallel_cuda_manual_seed(0)
        gpt = make_model_provider(model, perform_initialization=False)(pre_process=True, post_process=True).eval()
        torch_dist_io.load_model_weights([gpt], str(tmp_path / "mcore"))
        ours = megatron_logits([gpt], _tokens(model.vocab_size), model)
    assert model.mtp_num_layers == 1 and model.q_lora_rank and model.num_experts
    assert (ours - hf_logits_of(str(hf_dir), model.vocab_size)).abs().max().item() < 1e-5


@pytest.mark.parametrize("name", list(DEEPSEEK))
def test_hf_to_mcore_to_hf_is_bit_exact_mtp_layer_included(converted, tmp_path, name):
    hf_dir, mcore_dir, model = converted[name]
    out = mcore_to_hf(mcore_dir, tmp_path / "hf", progress=False)
    before, after = hf_state(hf_dir), hf_state(out)
    assert sorted(before) == sorted(after)
    assert all(before[key].dtype == after[key].dtype and torch.equal(before[key], after[key]) for key in before)
    assert json.loads((out / "config.json").read_text()) == json.loads((hf_dir / "config.json").read_text())
    mtp = [key for key in before if key.startswith(f"model.layers.{model.num_layers}.")]
    assert len(mtp) == (0 if model.mtp_num_layers is None else 20 + 3 * model.num_experts)


def test_bf16_round_trips_bit_exact_keeping_each_tensors_dtype(tmp_path):
    """DeepSeek publishes its expert bias in float32 beside bf16 weights (transformers keeps it so): each tensor
    keeps its dtype through megatron and back, the rest bf16; shards with an index on the way out."""
    hf_dir = save_tiny_deepseek("dsv3-qlora-yarn-mtp", tmp_path / "hf", dtype=torch.bfloat16)
    state = hf_state(hf_dir)
    state.update({k: t.float() for k, t in state.items() if k.endswith("e_score_correction_bias")})
    from safetensors.torch import save_file
    save_file(state, hf_dir / "model.safetensors", metadata={"format": "pt"})
    hf_to_mcore(hf_dir, tmp_path / "mcore", progress=False)
    stored = torch_dist_io.tensors_metadata(checkpoint_dir.iteration_dir(tmp_path / "mcore"))
    assert {k: m.dtype for k, m in stored.items() if m.dtype != torch.bfloat16} == {
        f"decoder.layers.{i}.mlp.router.expert_bias": torch.float32 for i in (1, 2, 3)} | {
        "mtp.layers.0.transformer_layer.mlp.router.expert_bias": torch.float32}
    out = mcore_to_hf(tmp_path / "mcore", tmp_path / "back", max_shard_bytes=40_000, progress=False)
    assert len(list(out.glob("*.safetensors"))) > 2 and (out / "model.safetensors.index.json").is_file()
    after = hf_state(out)
    assert sorted(after) == sorted(state)
    assert all(state[k].dtype == after[k].dtype and torch.equal(state[k], after[k]) for k in state)


def test_an_fp8_deepseek_converts_to_the_checkpoint_of_its_dequantized_weights(tmp_path, capsys):
    """DeepSeek-V3 as published: every projection FP8 with block scales (16 x 16 here, partial blocks at the odd
    sizes), the embeddings, norms, router and output head bf16 (the expert bias float32 beside them)."""
    from safetensors.torch import save_file
    from tests.test_fp8_checkpoint import by_element, quantize

    source = save_tiny_deepseek("dsv3-qlora-yarn-mtp", tmp_path / "source", dtype=torch.bfloat16)
    config = json.loads((source / "config.json").read_text())
    fp8, dequantized = {}, {}
    for name, tensor in hf_state(source).items():
        if tensor.dim() == 2 and name.endswith(("proj.weight", "proj_with_mqa.weight")):
            values, scales = quantize(tensor, 16)
            fp8[name], fp8[name + "_scale_inv"] = values, scales
            dequantized[name] = by_element(values, scales, 16)
        else:
            fp8[name] = dequantized[name] = tensor
    assert sum(t.dtype == torch.float8_e4m3fn for t in fp8.values()) > 100
    quantization = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}
    for directory, state, extra in ((tmp_path / "fp8", fp8, {"quantization_config": quantization}),
                                    (tmp_path / "bf16", dequantized, {})):
        directory.mkdir()
        save_file(state, directory / "model.safetensors")
        (directory / "config.json").write_text(json.dumps({**config, **extra}))
        hf_to_mcore(directory, tmp_path / f"{directory.name}-mcore", tp=2, progress=False)
        mcore_to_hf(tmp_path / f"{directory.name}-mcore", tmp_path / f"{directory.name}-back", progress=False)
    assert re.search(r"dequantized \d+ FP8 \(e4m3\) weights with their 16x16 block scales", capsys.readouterr().err)
    back, reference = hf_state(tmp_path / "fp8-back"), hf_state(tmp_path / "bf16-back")
    assert back.keys() == reference.keys() == dequantized.keys()
    assert all(torch.equal(back[k], reference[k]) and torch.equal(back[k], dequantized[k]) for k in back)


# --- config.json <-> ModelConfig ----------------------------------------------------------------------------

_YARN = {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
         "original_max_position_embeddings": 4096, "type": "yarn"}
_FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
# deepseek-ai/DeepSeek-V3's config.json (auto_map left out)
DEEPSEEK_V3_JSON = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3", "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "pretraining_tp": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "quantization_config": _FP8, "rms_norm_eps": 1e-06, "rope_scaling": _YARN,
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 128, "vocab_size": 129280}
# moonshotai/Kimi-K2-Base's config.json (auto_map left out): DeepseekV3ForCausalLM with model_type kimi_k2
KIMI_K2_JSON = {
    **DEEPSEEK_V3_JSON, "model_type": "kimi_k2", "bos_token_id": 163584, "eos_token_id": 163585,
    "first_k_dense_replace": 1, "max_position_embeddings": 131072, "n_group": 1, "n_routed_experts": 384,
    "num_attention_heads": 64, "num_key_value_heads": 64, "num_nextn_predict_layers": 0, "topk_group": 1,
    "routed_scaling_factor": 2.827, "rope_theta": 50000.0, "vocab_size": 163840,
    "rope_scaling": {**_YARN, "beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0}}


@pytest.mark.parametrize("name, published", [("deepseek-v3", DEEPSEEK_V3_JSON), ("kimi-k2", KIMI_K2_JSON)])
def test_the_published_configs_are_the_named_models(name, published):
    """The published config.json is the named model (but for the balance loss coefficient, the configs' 0.001:
    a training setting the named model takes from the paper); written back, it reads as the same model."""
    model = hf_format.config_from_hf(published)
    assert model.moe_aux_loss_coeff == 0.001
    assert model.replace(moe_aux_loss_coeff=models.get(name).moe_aux_loss_coeff) == models.get(name)
    written = hf_format.config_to_hf(model)
    assert written["architectures"] == ["DeepseekV3ForCausalLM"] and written["rope_scaling"]["type"] == "yarn"
    assert hf_format.config_from_hf(written) == model


def test_a_written_config_json_is_what_transformers_builds(converted):
    """The config.json written for a megatron model (no original one) loads in transformers as the same model."""
    import transformers

    for hf_dir, _, model in converted.values():
        written = hf_format.config_to_hf(model)
        ours = transformers.DeepseekV3Config(**{k: v for k, v in written.items() if k != "architectures"})
        theirs = transformers.AutoConfig.from_pretrained(hf_dir)
        for field in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                      "n_routed_experts", "n_shared_experts", "first_k_dense_replace", "num_experts_per_tok",
                      "routed_scaling_factor", "tie_word_embeddings", "rope_interleave", "num_nextn_predict_layers"):
            assert getattr(ours, field) == getattr(theirs, field), field
        assert {k: v for k, v in ours.rope_parameters.items() if k != "type"} == {
            k: v for k, v in theirs.rope_parameters.items() if k != "type"} or model.rotary_scaling_factor == 1


def test_a_dense_mla_model_writes_a_config_transformers_takes():
    import transformers

    dense = models.get("deepseek-v3-tiny").replace(
        num_experts=None, moe_ffn_hidden_size=None, moe_shared_expert_intermediate_size=None, moe_router_topk=2,
        moe_layer_freq=1, moe_router_score_function="softmax", moe_router_enable_expert_bias=False,
        moe_router_num_groups=None, moe_router_group_topk=None, moe_router_topk_scaling_factor=None,
        moe_aux_loss_coeff=0.0)
    written = hf_format.config_to_hf(dense)
    config = transformers.DeepseekV3Config(**{k: v for k, v in written.items() if k != "architectures"})
    assert config.first_k_dense_replace == dense.num_layers
    assert hf_format.config_from_hf(written).replace(seq_length=dense.seq_length) == dense


def _edited(**changes) -> dict:
    return {**DEEPSEEK_V3_JSON, **changes}


@pytest.mark.parametrize("config, message", [
    (_edited(rope_interleave=False), "rope_interleave=False is not supported"),
    (_edited(topk_method="greedy"), "topk_method='greedy'"),
    (_edited(scoring_func="softmax"), "scoring_func='softmax'"),
    (_edited(topk_group=3), "they agree only when num_experts_per_tok = 2 x topk_group"),
    (_edited(norm_topk_prob=False), "norm_topk_prob=False with num_experts_per_tok=8"),
    (_edited(rope_scaling={**_YARN, "mscale": None}), "mscale_all_dim=1.0 but no mscale"),
    (_edited(rope_scaling={**_YARN, "type": "dynamic"}), "rope scaling 'dynamic'"),
    (_edited(rope_scaling={**_YARN, "truncate": False}), "truncate=false"),
    (_edited(hidden_act="gelu"), "hidden_act='gelu'"),
], ids=["rope-not-interleaved", "greedy-router", "softmax-router", "groups", "not-renormalised",
        "mscale", "rope-type", "truncate", "activation"])
def test_what_megatron_cannot_express_is_refused_by_name(config, message):
    with pytest.raises(hf_format.UnsupportedCheckpoint, match=re.escape(message)):
        hf_format.config_from_hf(config)


def test_a_megatron_model_deepseek_cannot_hold_is_refused_by_name():
    """Keeping 2 of 4 expert groups for a top 2 rates each group by its best expert in megatron: transformers
    rates a group by its best two, so no DeepseekV3ForCausalLM computes that router."""
    with pytest.raises(hf_format.UnsupportedCheckpoint, match="group-limited routing with topk != 2 x group_topk"):
        hf_format.config_to_hf(models.get("deepseek-v3-tiny").replace(moe_router_topk=2))
    with pytest.raises(hf_format.UnsupportedCheckpoint, match="mtp_num_layers=1 without multi-latent attention"):
        hf_format.config_to_hf(models.get("qwen3-tiny").replace(mtp_num_layers=1))
    tiny = models.get("deepseek-v3-tiny")  # top 4 over 2 of 4 groups: each group rated by its best two
    assert hf_format.config_from_hf(hf_format.config_to_hf(tiny)).replace(seq_length=tiny.seq_length) == tiny


def test_an_mtp_copy_that_differs_from_the_model_is_one_clear_error(tmp_path):
    from safetensors.torch import save_file

    hf_dir = save_tiny_deepseek("dsv3-qlora-yarn-mtp", tmp_path / "hf")
    state = hf_state(hf_dir)
    state["model.layers.4.shared_head.head.weight"][3, 5] += 1
    save_file(state, hf_dir / "model.safetensors")
    with pytest.raises(ConversionError, match=re.escape("model.layers.4.shared_head.head.weight differs from "
                                                        "lm_head.weight")):
        hf_to_mcore(hf_dir, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_verify_command_checks_a_deepseek_checkpoint(converted):
    """``models.verify`` (its multi-rank path is test_conversion's) on the YaRN + MTP model, 32 positions of 16
    original ones."""
    hf_dir, mcore_dir, _ = converted["dsv3-qlora-yarn-mtp"]
    done = subprocess.run([sys.executable, "-m", "models.verify", "--hf-dir", str(hf_dir), "--load", str(mcore_dir),
                           "--atol", "1e-5"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"max \|logit difference\| \S+ over \(2, 32, 96\) logits \(TP 1, PP 1, EP 1; atol 1e-05\): OK",
                     done.stdout), done.stdout


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_checkpoint_megatron_saved_at_ep2_tp2_converts_to_transformers_and_back(tmp_path):
    """deepseek-v3-tiny (its router rating each group by its best two experts, as DeepSeek's does) saved by megatron
    at EP2 x TP2 with the flow's grouped experts: written as HF with a config.json built from the model, it gives
    megatron's logits in transformers, reads back as the same model and converts back bit-exactly."""
    from tests.conversion_ranks import save_like_training

    model = models.get("deepseek-v3-tiny")
    trained = tmp_path / "trained"
    before = _same_on_every_rank(run_ranks(4, save_like_training, model, str(trained), 2, 1, 100, 2,
                                           dict(moe_grouped_gemm=True, moe_token_dispatcher_type="alltoall")))
    hf_dir = mcore_to_hf(trained, tmp_path / "hf", model=model, progress=False)
    assert json.loads((hf_dir / "config.json").read_text())["architectures"] == ["DeepseekV3ForCausalLM"]
    assert hf_format.config_from_hf(json.loads((hf_dir / "config.json").read_text())).replace(
        seq_length=model.seq_length) == model
    assert (hf_logits_of(str(hf_dir), model.vocab_size) - before).abs().max().item() < 1e-5
    hf_to_mcore(hf_dir, tmp_path / "back", progress=False)
    again = hf_state(mcore_to_hf(tmp_path / "back", tmp_path / "again", progress=False))
    assert all(torch.equal(t, again[k]) for k, t in hf_state(hf_dir).items())

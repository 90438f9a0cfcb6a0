"""Qwen3.5 through megatron-core's HybridModel from the project's local specs (models/hybrid.py): built on the
CPU without Transformer Engine or flash-linear-attention, its parameters counted by ``ModelConfig``, and its
logits and loss those of transformers' ``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM`` made from the same
config with the same weights (copied here by the layout each side documents, independently of the
converter). Releases without HybridModel refuse the model in one line."""

from __future__ import annotations

import pytest
import torch
import transformers
from packaging.version import Version

import models
from adapter.registry import installed_megatron_core_version
from models import hybrid
from models.config import LINEAR_ATTENTION, ModelConfigError

NO_HYBRID = Version(installed_megatron_core_version()) < Version(hybrid.HYBRID_SINCE)
needs_hybrid = pytest.mark.skipif(NO_HYBRID, reason=f"megatron-core {installed_megatron_core_version()} has no "
                                                    f"HybridModel (0.18 and later)")
NO_QWEN35 = not hasattr(transformers, "Qwen3_5TextConfig")
needs_qwen35 = pytest.mark.skipif(NO_QWEN35, reason=f"transformers {transformers.__version__} has no Qwen3.5 "
                                                    "(5.23 and later)")


def test_layer_pattern_is_a_mixer_then_an_mlp_or_moe_per_layer():
    assert hybrid.layer_pattern(models.get("qwen3.5-tiny")) == "G-G-G-*-"
    assert hybrid.layer_pattern(models.get("qwen3.5-moe-tiny")) == "GEGEGE*E"


def test_gated_delta_net_sizes_without_layer_types_are_refused():
    with pytest.raises(ModelConfigError, match="linear_num_value_heads=64 without layer_types"):
        models.get("qwen3-tiny", linear_num_value_heads=64)
    with pytest.raises(ModelConfigError, match="one of 'linear_attention' or 'full_attention' per layer, 4 in all"):
        models.get("qwen3.5-tiny", layer_types=(LINEAR_ATTENTION,) * 3)


@pytest.mark.skipif(not NO_HYBRID, reason="this megatron-core has HybridModel")
def test_an_old_release_names_the_one_a_hybrid_model_needs():
    with pytest.raises(ModelConfigError, match=r"install megatron-core>=0\.18"):
        hybrid.check_release()


def _hf_config(model):
    """transformers' config of ``model``, from the config.json the project writes for it."""
    from models.hf import config_to_hf

    return transformers.AutoConfig.for_model(**{k: v for k, v in config_to_hf(model).items()
                                                if k not in ("architectures", "torch_dtype")})


def _gated_qkv(attn, model) -> torch.Tensor:
    """megatron's gated linear_qkv rows, per query group: its query heads, their gate heads, its key head and
    its value head. HF's q_proj holds each head's query then its gate."""
    d, groups = model.head_dim, model.num_query_groups
    q_and_gate = attn.q_proj.weight.reshape(groups, -1, 2, d, model.hidden_size)
    k, v = (w.reshape(groups, 1, d, model.hidden_size) for w in (attn.k_proj.weight, attn.v_proj.weight))
    return torch.cat([q_and_gate[:, :, 0], q_and_gate[:, :, 1], k, v], dim=1).reshape(-1, model.hidden_size)


def _layer_weights(hf_layer, model, index: int) -> dict:
    """One HF decoder layer as megatron's two hybrid layers (``2 * index``: the mixer; ``+ 1``: its MLP/MoE).
    Norms stored as gamma - 1 on both sides, but Gated DeltaNet's output norm, which HF stores as gamma."""
    mixer, mlp = f"decoder.layers.{2 * index}.", f"decoder.layers.{2 * index + 1}."
    out = {mixer + "input_layernorm.weight": hf_layer.input_layernorm.weight,
           mlp + "pre_mlp_layernorm.weight": hf_layer.post_attention_layernorm.weight}
    if model.layer_types[index] == LINEAR_ATTENTION:
        gdn = hf_layer.linear_attn
        out |= {mixer + "self_attention.in_proj.weight": torch.cat(
            [gdn.in_proj_qkv.weight, gdn.in_proj_z.weight, gdn.in_proj_b.weight, gdn.in_proj_a.weight]),
            mixer + "self_attention.out_norm.weight": gdn.norm.weight - 1,
            **{mixer + f"self_attention.{n}": gdn.get_parameter(n)
               for n in ("conv1d.weight", "A_log", "dt_bias", "out_proj.weight")}}
    else:
        attn = hf_layer.self_attn
        out |= {mixer + "self_attention.linear_qkv.weight": _gated_qkv(attn, model),
                mixer + "self_attention.q_layernorm.weight": attn.q_norm.weight,
                mixer + "self_attention.k_layernorm.weight": attn.k_norm.weight,
                mixer + "self_attention.linear_proj.weight": attn.o_proj.weight}
    block = hf_layer.mlp
    if model.num_experts is None:
        return out | {mlp + "mlp.linear_fc1.weight": torch.cat([block.gate_proj.weight, block.up_proj.weight]),
                      mlp + "mlp.linear_fc2.weight": block.down_proj.weight}
    shared = block.shared_expert
    return out | {mlp + "mlp.router.weight": block.gate.weight,
                  mlp + "mlp.experts.linear_fc1.weight": block.experts.gate_up_proj,
                  mlp + "mlp.experts.linear_fc2.weight": block.experts.down_proj,
                  mlp + "mlp.shared_experts.linear_fc1.weight": torch.cat([shared.gate_proj.weight,
                                                                           shared.up_proj.weight]),
                  mlp + "mlp.shared_experts.linear_fc2.weight": shared.down_proj.weight,
                  mlp + "mlp.shared_experts.gate_weight": block.shared_expert_gate.weight}


def _megatron_weights(hf_model, model) -> dict:
    weights = {"embedding.word_embeddings.weight": hf_model.model.embed_tokens.weight,
               "decoder.final_norm.weight": hf_model.model.norm.weight, "output_layer.weight": hf_model.lm_head.weight}
    for index, layer in enumerate(hf_model.model.layers):
        weights |= _layer_weights(layer, model, index)
    return weights


@needs_hybrid
@needs_qwen35
@pytest.mark.parametrize("name", ["qwen3.5-tiny", "qwen3.5-moe-tiny"])
def test_the_hybrid_model_gives_transformers_logits(name):
    from models.provider import make_model_provider
    from tests.kernel_reference import one_rank_model_parallel

    model = models.get(name)
    torch.manual_seed(0)
    theirs = transformers.AutoModelForCausalLM.from_config(_hf_config(model), attn_implementation="sdpa").eval()
    with torch.no_grad():  # HF initialises its zero-centred norms to zero: make every weight count
        for param in theirs.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    with one_rank_model_parallel():
        ours = make_model_provider(model)().eval()
        weights = _megatron_weights(theirs, model)
        own = {k: v for k, v in ours.state_dict().items() if not k.endswith("_extra_state")}
        assert sorted(own) == sorted(weights)
        assert sum(p.numel() for p in ours.parameters()) == model.num_parameters() == sum(
            p.numel() for p in theirs.parameters())
        ours.load_state_dict({k: w.detach().clone() for k, w in weights.items()}, strict=False)
        tokens = torch.randint(0, model.vocab_size, (2, model.seq_length), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            logits = ours(tokens, torch.arange(model.seq_length).expand_as(tokens), None)
            want = theirs(input_ids=tokens).logits
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)


def _flow_argv(model: str, *extra: str) -> list[str]:
    return ["--model", model, "--micro-batch-size", "2", "--global-batch-size", "4", "--seq-length", "64",
            "--train-iters", "6", "--lr", "3e-3", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1", "--mock-data",
            "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "0", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--use-distributed-optimizer", "--seed", "7", *extra]


def _expert_load_layers(tensorboard) -> set[int]:
    """The layers whose expert load the run wrote to TensorBoard (patches/expert_load.py), by megatron's index."""
    from scripts.plot_loss import read_scalars

    prefix = "moe/expert_load_max_over_mean_layer_"
    return {int(tag[len(prefix):]) for tag in read_scalars(tensorboard) if tag.startswith(prefix)}


@needs_hybrid
@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.megatron_training
@pytest.mark.parametrize("name", ["qwen3.5-tiny", "qwen3.5-moe-tiny"])
def test_the_flow_trains_a_hybrid_model_and_resumes_it_bit_exactly(name, tmp_path):
    """scripts/pretrain_gpt.py's pretrain (megatron.training's, flow/hybrid.py's builder) in one rank's process
    with --model qwen3.5-...: six iterations saved at 3, the loss falling, then the run resumed from 3 gives
    iterations 4-6 bit for bit (the MoE flavour logs its experts' load, one count per MoE block: megatron's
    layers 1, 3, 5 and 7 of the pattern GEGEGE*E, the model's four layers)."""
    from tests.distributed import run_ranks
    from tests.flow_ranks import logged_losses, run_pretrain, stopped_at

    saved, tensorboard = tmp_path / "saved", tmp_path / "tensorboard"
    first = run_ranks(1, run_pretrain, _flow_argv(name, "--save", str(saved), "--save-interval", "3",
                                                  "--tensorboard-dir", str(tensorboard)))
    curve = logged_losses(first)
    assert sorted(curve) == list(range(1, 7)) and curve[6] < curve[1]
    if name.endswith("moe-tiny"):
        assert _expert_load_layers(tensorboard) == {1, 3, 5, 7}
    at3 = stopped_at(saved, 3, tmp_path / "at3")
    resumed = logged_losses(run_ranks(1, run_pretrain, _flow_argv(name, "--load", str(at3))))
    assert resumed == {i: curve[i] for i in range(4, 7)}


# scripts/pretrain_gpt.py (megatron.training's own pretrain, flow/hybrid.py's builder) on two ranks
SCRIPT_LAYOUTS = {"qwen3.5-tiny": ["--tensor-model-parallel-size", "2"],
                  "qwen3-next-tiny": ["--expert-model-parallel-size", "2"]}


@pytest.mark.multiproc  # starts ranks for the test below (tests/test_markers.py reads the mark)
def _script_losses(tmp_path, name: str, run: str, *extra: str) -> tuple[dict[int, float], str]:
    """(iteration -> the float32 training loss megatron wrote to TensorBoard, rank 0's output) of
    scripts/pretrain_gpt.py on ``name``'s SCRIPT_LAYOUTS; the test fails with the log's tail otherwise."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.distributed import launch_script

    events = tmp_path / run
    argv = [*_flow_argv(name, *SCRIPT_LAYOUTS[name], *extra), "--tensorboard-dir", str(events),
            "--data-cache-path", str(tmp_path / "cache")]
    outputs = launch_script("scripts/pretrain_gpt.py", argv, env={"ADAPTER_BACKEND": "cpu"})
    assert all(status == 0 for status, _ in outputs), outputs[-1][1][-6000:]
    accumulator = EventAccumulator(str(events), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {e.step: e.value for e in accumulator.Scalars("lm loss")}, outputs[0][1]


@needs_hybrid
@needs_qwen35
@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(SCRIPT_LAYOUTS))
def test_the_script_trains_a_hybrid_model_resumes_it_bit_exactly_and_converts_it(name, tmp_path):
    """scripts/pretrain_gpt.py --model NAME (TP 2, or EP 2 for the MoE one): six iterations saved at 3, the
    loss falling; resumed from 3, iterations 4-6 to the bit; the last checkpoint converts to a Hugging Face
    model that gives the logits megatron gives on it."""
    from models.conversion import mcore_to_hf
    from tests.conversion_ranks import hf_logits_of, megatron_logits_from
    from tests.distributed import run_ranks
    from tests.flow_ranks import stopped_at

    saved = tmp_path / "saved"
    curve, _ = _script_losses(tmp_path, name, "first", "--save", str(saved), "--save-interval", "3")
    assert sorted(curve) == list(range(1, 7)) and curve[6] < curve[1] - 0.3, curve
    at3 = stopped_at(saved, 3, tmp_path / "at3")
    resumed, printed = _script_losses(tmp_path, name, "resumed", "--load", str(at3))
    assert f"successfully loaded checkpoint from {at3}" in printed
    assert resumed == {i: curve[i] for i in range(4, 7)}
    model = models.get(name)
    hf_dir = mcore_to_hf(saved, tmp_path / "hf", model=model, progress=False)
    logits = run_ranks(1, megatron_logits_from, model, str(saved), 1, 1)[0]
    assert (hf_logits_of(str(hf_dir), model.vocab_size) - logits).abs().max().item() < 1e-5


# the launchers' settings (scripts/pretrain_qwen35_*.sh) at toy size on two ranks
LAUNCHER_LAYOUTS = {
    "tp2-sp-recompute": ("qwen3.5-tiny", "--tensor-model-parallel-size", "2", "--sequence-parallel",
                         "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers",
                         "1", "--bf16", "--overlap-grad-reduce", "--overlap-param-gather"),
    "pp2": ("qwen3.5-tiny", "--pipeline-model-parallel-size", "2"),
    "ep2-grouped-alltoall": ("qwen3.5-moe-tiny", "--expert-model-parallel-size", "2", "--moe-grouped-gemm",
                             "--moe-token-dispatcher-type", "alltoall", "--moe-permute-fusion"),
}


@needs_hybrid
@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.megatron_training
@pytest.mark.parametrize("layout", list(LAUNCHER_LAYOUTS))
def test_the_flow_trains_a_hybrid_model_at_the_launchers_layouts(layout):
    """TP 2 with sequence parallelism and full recompute of megatron's hybrid layers, PP 2 (the pattern split
    over two stages) and EP 2 with grouped experts: six iterations on two ranks, the loss falling."""
    from tests.distributed import run_ranks
    from tests.flow_ranks import logged_losses, run_pretrain

    name, *settings = LAUNCHER_LAYOUTS[layout]
    curve = logged_losses(run_ranks(2, run_pretrain, _flow_argv(name, *settings)))
    assert sorted(curve) == list(range(1, 7)) and curve[6] < curve[1] - 0.3


def _gated_delta_net_layer_bytes(tokens: int, tp: int) -> float:
    """By hand, one Qwen3.5-9B Gated DeltaNet layer (16 key and 32 value heads of 128) and its MLP (FFN
    12288), flash-linear-attention's kernel, no dropout, sequence parallel, bf16."""
    e, h, f, k_d, v_d, n_v = 2, 4096, 12288, 16 * 128, 32 * 128, 32
    sequence_region = 4 * e * h  # the two norms' inputs, in_proj's and FC1's inputs
    mixer = e * (2 * k_d + 2 * v_d + 2 * n_v) + e * (2 * k_d + v_d) + e * 2 * k_d + 8 * n_v + 2 * e * v_d
    return tokens * (sequence_region + mixer + 3 * e * f) / tp


def _attention_layer_bytes(tokens: int, tp: int) -> float:
    """By hand, one Qwen3.5-9B gated attention layer (16 query and 4 key-value heads of 256, QK-norm) and its
    MLP, flash attention, sequence parallel."""
    e, h, f, a, g, d = 2, 4096, 12288, 16, 4, 256
    attention = e * (a * d + 2 * g * d) + e * a * d + 4 * a + (e * d + 4) * (a + g) + 2 * e * a * d  # + the gate
    return tokens * (4 * e * h + attention + 3 * e * f) / tp


def test_the_memory_plan_counts_gated_delta_net_layers_by_hand():
    """Qwen3.5-9B at TP 2 x PP 2: every parameter once over TP and stages (Gated DeltaNet's output norm, the
    layer norms and QK-norms whole), and each stage's activations three Gated DeltaNet layers to one
    attention layer; full recompute keeps one input per megatron layer, two per model layer."""
    from flow.memory_plan import plan

    model = models.get("qwen3.5-9b")
    sizes = dict(tp=2, pp=2, dp=1, micro_batch_size=1, global_batch_size=2, seq_length=4096)
    stages = plan(model, **sizes).stages
    whole = 24 * 128 + 8 * 2 * 256 + 32 * 2 * 4096 + 4096  # GDN out norms, QK-norms, layer norms, final norm
    assert (sum(s.parameters for s in stages) - whole) * 2 + whole == model.num_parameters()
    layer = (12 * _gated_delta_net_layer_bytes(4096, 2) + 4 * _attention_layer_bytes(4096, 2)) / 16
    assert [s.activations for s in stages] == [round(2 * 16 * layer), round(16 * layer)]
    recomputed = plan(model, **sizes, recompute="full").stages[1]
    assert recomputed.activations == round(32 * 4096 * 2 * 4096 / 2)


@pytest.mark.parametrize("name, gpt_model", [("qwen2.5-tiny", True), ("qwen3.5-tiny", False)])
def test_megatrons_deprecation_line_is_logged_only_where_a_gpt_model_runs(name, gpt_model, caplog):
    """docs/ARCHITECTURE.md, "GPTModel and HybridModel": the GPT-stack models build GPTModel (and 0.19 says it
    is deprecated), the hybrid ones HybridModel (and nothing says so)."""
    from models.provider import make_model_provider
    from tests.kernel_reference import one_rank_model_parallel

    if not gpt_model and NO_HYBRID:
        pytest.skip("this megatron-core has no HybridModel")
    with one_rank_model_parallel(), caplog.at_level("WARNING", logger="megatron.core.models.gpt.gpt_model"):
        built = make_model_provider(models.get(name))()
    deprecated = [r for r in caplog.records if "GPTModel IS DEPRECATED" in r.getMessage()]
    assert type(built).__name__ == ("GPTModel" if gpt_model else "HybridModel")
    says_so = gpt_model and Version(installed_megatron_core_version()) >= Version("0.19")
    assert len(deprecated) == (1 if says_so else 0)

"""The memory plan of DeepSeek-V3's architecture (issue 45): multi-latent attention's activations against
torch's saved-tensor hooks on megatron's MLA layer, its and the MTP layer's parameters against the model's
own count, uneven pipeline splits, selective recompute modules by hand, and the DeepSeek-V3 and Kimi-K2
launchers' dry runs (the flow takes their commands, the plan fits a 64 GB device)."""

from __future__ import annotations

import re

import pytest
import torch

import models
from adapter.parallel import PipelineSplit
from flow import memory_plan
from flow.memory_plan import PlanError, plan, plan_from_args
from tests.recompute_ranks import SavedActivations
from tests.test_memory_plan import DEVICE_BYTES, RESERVE, dry_run

DSV3, KIMI = models.get("deepseek-v3"), models.get("kimi-k2")
H, V = 7168, 129280
# the launcher's layout: TP 1 x PP 8 x EP 64 on 512 devices, 8 / 6 x 8 / 5 layers
LAYOUT = dict(tp=1, pp=8, dp=64, ep=64, etp=1, micro_batch_size=1, global_batch_size=7680, seq_length=4096,
              split=PipelineSplit(first=8, last=5))


def _measured_latent_attention(recompute_modules: list[str] | None) -> tuple[int, int]:
    """(bytes megatron's MLA layer saves for backward beyond its input, tokens) for deepseek-v3-tiny's first
    MoE layer at TP 1, fp32, the CPU provider's unfused core attention."""
    from models.provider import build_model, transformer_config
    from tests.kernel_reference import one_rank_model_parallel

    model, batch = models.get("deepseek-v3-tiny"), 2
    # the cpu provider's compiled RMSNorm saves what a fused norm saves; once earlier tests in this process
    # have spent torch.compile's recompile limit on it (grad mode, shapes) it runs eager and saves more: the
    # measurement starts from a fresh compile cache, as a training process does
    torch.compiler.reset()
    recompute = {}
    if recompute_modules:
        recompute = dict(recompute_granularity="selective", recompute_modules=recompute_modules)
    with one_rank_model_parallel():
        attention = build_model(model, transformer_config(model, **recompute)).decoder.layers[1].self_attention
        hidden = torch.randn(model.seq_length, batch, model.hidden_size, requires_grad=True)
        saved = SavedActivations(attention.parameters())
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda tensor: tensor):
            attention(hidden, attention_mask=None)
        # at the forward's end, as the pipeline holds it; the input is the layer's norm output, counted there
        measured = saved.nbytes() - hidden.untyped_storage().nbytes()
    return measured, model.seq_length * batch


@pytest.mark.slow  # megatron's import and the model's build, ~10 s on 2 cores
@pytest.mark.parametrize("modules", [None, ["mla_up_proj"]])
def test_latent_attention_activations_match_what_megatrons_layer_saves(modules):
    """What the plan counts for MLA per token (latents, up-projected q / k / v, core attention's output and
    softmax) is what torch's saved-tensor hooks see megatron's MLASelfAttention keep, plus RoPE's cos / sin
    tables, which the plan leaves out (per position, not per token: 4 tables of s x r for the query and key
    without recompute; the recomputed up projection keeps its rotary frequencies, s x r, instead). On this
    unfused path ``mla_up_proj`` releases nothing the plan counts: the torch attention saved head-major
    copies of q, k and v, which megatron's release of the up projection's outputs does not reach."""
    model = models.get("deepseek-v3-tiny")
    measured, tokens = _measured_latent_attention(modules)
    e, s, r = 4, model.seq_length, model.qk_pos_emb_head_dim
    tables = (4 if modules is None else 1) * e * s * r
    planned = tokens * memory_plan._latent_attention_activations(
        model, e, s, tp=1, sequence_parallel=False, flash_attention=False, recomputed=frozenset(modules or ()),
        attention_dropout=False)
    assert measured == planned + tables


def test_latent_attention_per_token_by_hand():
    """One DeepSeek-V3 MoE layer of a middle stage at TP 2 with sequence parallelism, flash attention, no
    recompute: the layer's norms and latents over the sequence split, q / k / v, the attention output and
    log-sum-exp, the routed and shared experts over TP."""
    e, t, a, q, kv, qk, r, v = 2, 2, 128, 1536, 512, 128, 64, 128
    experts, k, f = 256, 8, 2048
    sequence = 4 * e * H + 8 * experts + e * (2 * q + 2 * kv) + 8
    split = e * a * (2 * (qk + r) + v) + e * a * v + 4 * a + k * (e * H + 3 * e * f) + 3 * e * f
    per_token = sequence / t + split / t
    layout = dict(LAYOUT, tp=2, dp=32, ep=64, global_batch_size=256)
    stage = plan(DSV3, **layout).stages[3]
    assert (stage.layers, stage.passes_in_flight) == (8, 5)
    assert stage.activations == round(5 * 8 * 4096 * per_token)


def test_the_stages_hold_deepseek_v3_as_the_model_counts_it():
    """Over the uneven split, every parameter is on one stage (the routed experts on one of EP 64 devices),
    plus the MTP stage's own word embedding; the MTP row is the MTP layer and that embedding."""
    stages = plan(DSV3, **LAYOUT).stages
    dense = sum(s.parameters - s.expert_parameters for s in stages)
    assert dense + 64 * sum(s.expert_parameters for s in stages) == DSV3.num_parameters() + V * H
    assert round((DSV3.num_parameters() - DSV3.mtp_layer_parameters()) / 1e9) == 671
    assert [s.layers for s in stages] == [8, 8, 8, 8, 8, 8, 8, 5]
    mtp_experts = 256 * 3 * H * 2048 // 64
    assert stages[-1].mtp_parameters == DSV3.mtp_layer_parameters() - 64 * mtp_experts + mtp_experts + V * H
    assert [s.mtp_parameters for s in stages[:-1]] == [0] * 7


def test_kimi_k2_is_the_published_size_over_its_stages():
    stages = plan(KIMI, tp=1, pp=16, dp=32, ep=32, etp=1, micro_batch_size=1, global_batch_size=7680,
                  seq_length=4096, split=PipelineSplit(first=3, last=2)).stages
    dense = sum(s.parameters - s.expert_parameters for s in stages)
    assert dense + 32 * sum(s.expert_parameters for s in stages) == KIMI.num_parameters()
    assert round(KIMI.num_parameters() / 1e11) == 10  # 1.03T
    assert [s.layers for s in stages] == [3] + [4] * 14 + [2]
    assert all(s.mtp_parameters == 0 for s in stages)


def test_mtp_logits_and_recomputed_activations_by_hand():
    """The last stage holds a second set of logits for the MTP layer (its output layer's input, the logits,
    the cross entropy's fp32 copy) and, under full uniform recompute, the next tokens' embedding."""
    layout = dict(LAYOUT, recompute="full")
    with_mtp, without = plan(DSV3, **layout).stages[-1], plan(DSV3.replace(mtp_num_layers=None), **layout).stages[-1]
    tokens, e = 4096, 2
    assert with_mtp.logits - without.logits == tokens * (e * H + (e + 4) * V)
    assert with_mtp.activations - without.activations == tokens * e * H


def test_mtp_activations_without_recompute_by_hand():
    """Not recomputed, the MTP layer keeps the next tokens' embedding, its projection's input (2h), its final
    norm's input and a whole MoE layer (TP 1, flash attention: no sequence split)."""
    e, a, q, kv, qk, r, v, experts, k, f = 2, 128, 1536, 512, 128, 64, 128, 256, 8, 2048
    layer = (4 * e * H + 8 * experts + e * (2 * q + 2 * kv + r) + 8 + e * a * (2 * (qk + r) + v) + e * a * v
             + 4 * a + k * (e * H + 3 * e * f) + 3 * e * f)
    with_mtp, without = plan(DSV3, **LAYOUT).stages[-1], plan(DSV3.replace(mtp_num_layers=None), **LAYOUT).stages[-1]
    assert with_mtp.activations - without.activations == 4096 * (4 * e * H + layer)


def test_selective_recompute_modules_drop_what_they_recompute():
    """Per token of a DeepSeek-V3 MoE layer at TP 1: ``layernorm`` the two norm outputs (2eh), ``moe_act``
    each routed token's FC2 input (k x e f_e), ``mla_up_proj`` the up-projected q, k, v."""
    e, a, k, f = 2, 128, 8, 2048
    layout = dict(LAYOUT, recompute="selective")
    core = plan(DSV3, **layout, recompute_modules=("core_attn",)).stages[3]
    tokens_layers = 4096 * 8 * core.passes_in_flight
    for modules, saved in ((("core_attn", "layernorm"), 2 * e * H), (("core_attn", "moe_act"), k * e * f),
                           (("core_attn", "mla_up_proj"), e * a * (2 * 192 + 128))):
        stage = plan(DSV3, **layout, recompute_modules=modules).stages[3]
        assert core.activations - stage.activations == tokens_layers * saved


@pytest.mark.parametrize("change, message", [
    (dict(recompute="selective", recompute_modules=("attention",)), "recompute modules attention: megatron-core"),
    (dict(split=PipelineSplit(first=7, last=7)), "61 layers over pipeline 8"),
    (dict(recompute="full", recompute_num_layers=2), "full uniform recompute of 2 layers a group with MTP layers"),
])
def test_plan_refuses_what_megatron_would(change, message):
    with pytest.raises(PlanError, match=re.escape(message)):
        plan(DSV3, **{**LAYOUT, **change})


def test_cli_reads_the_split_and_the_modules(capsys):
    argv = ["--world-size", "512", "--model", "deepseek-v3", "--pipeline-model-parallel-size", "8",
            "--decoder-first-pipeline-num-layers", "8", "--decoder-last-pipeline-num-layers", "5",
            "--expert-model-parallel-size", "64", "--expert-tensor-parallel-size", "1", "--bf16",
            "--use-distributed-optimizer", "--use-flash-attn", "--recompute-granularity", "selective",
            "--recompute-modules", "mla_up_proj", "moe_act", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--micro-batch-size", "1", "--eval-interval", "1000"]
    assert memory_plan.main(argv) == 0
    out = capsys.readouterr().out
    assert "selective recompute of mla_up_proj moe_act" in out and "of which MTP (M)" in out
    expected = plan(DSV3, **{**LAYOUT, "global_batch_size": 64}, recompute="selective",
                    recompute_modules=("mla_up_proj", "moe_act"))
    assert plan_from_args(argv)[0] == expected


LAUNCHERS = {
    "deepseek-v3": ("pretrain_deepseek_v3.sh", dict(tp=1, pp=8, ep=64, devices=512, sizes=[8] * 7 + [5])),
    "kimi-k2": ("pretrain_kimi_k2.sh", dict(tp=1, pp=16, ep=32, devices=512, sizes=[3] + [4] * 14 + [2])),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAUNCHERS))
def test_launcher_dry_run_prints_a_command_the_flow_accepts_and_a_plan_that_fits(tmp_path, name):
    script, layout = LAUNCHERS[name]
    done, args, expected = dry_run(tmp_path, script, name, layout)
    assert args.multi_latent_attention and expected.model.multi_latent_attention
    assert args.mtp_num_layers == expected.model.mtp_num_layers == (1 if name == "deepseek-v3" else None)
    assert [s.layers for s in expected.stages] == layout["sizes"]
    for row in ("weights", "grads", "optimizer", "activations", "logits", "total"):
        line = next(line for line in done.stdout.splitlines() if line.startswith(f"{row} (GiB)"))
        assert line.split()[2:] == [f"{s.gib()[row]:.2f}" for s in expected.stages]
    assert ("of which MTP (M)" in done.stdout) == (name == "deepseek-v3")
    peak = re.search(r"needs ([\d.]+) GiB per device \(stage (\d+)\)", done.stdout)
    assert (float(peak.group(1)), int(peak.group(2))) == (round(expected.peak.total / 2**30, 1), expected.peak.stage)
    assert expected.peak.total < DEVICE_BYTES - RESERVE

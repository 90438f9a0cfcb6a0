"""The per-device memory plan against hand calculations, and the Qwen2.5-72B launcher's dry run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import models
from adapter.training import memory_plan
from adapter.training.memory_plan import PlanError, passes_in_flight, plan, plan_from_args
from models.config import ModelConfig, ModelConfigError

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "pretrain_qwen_72b.sh"
QWEN72B = models.get("qwen2.5-72b")
# the launcher's layout: 4 nodes x 8 devices
RECIPE = dict(tp=8, pp=4, vpp=5, dp=1, micro_batch_size=2, global_batch_size=128, seq_length=4096)
RECIPE_ARGS = ["--model", "qwen2.5-72b", "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "4",
               "--num-layers-per-virtual-pipeline-stage", "4", "--sequence-parallel", "--bf16",
               "--use-distributed-optimizer", "--use-flash-attn", "--micro-batch-size", "2",
               "--global-batch-size", "128", "--seq-length", "4096", "--hidden-dropout", "0.0",
               "--attention-dropout", "0.0"]


def _qwen72b_stage_parameters(first: bool, last: bool, tp: int = 8, layers: int = 20) -> int:
    """By hand: Qwen2.5-72B's per-layer shapes, split over TP except the two RMSNorm weights."""
    h, f, heads, groups, d, vocab = 8192, 29568, 64, 8, 128, 152064
    qkv = (heads + 2 * groups) * d
    split = layers * (qkv * h + qkv + h * h + 2 * f * h + f * h)
    whole = layers * 2 * h
    if first:
        split += vocab * h
    if last:
        split += vocab * h
        whole += h
    return split // tp + whole


def test_72b_weights_grads_optimizer_by_hand():
    result = plan(QWEN72B, **RECIPE)
    assert [s.layers for s in result.stages] == [20, 20, 20, 20]
    for stage in result.stages:
        parameters = _qwen72b_stage_parameters(stage.stage == 0, stage.stage == 3)
        assert stage.parameters == parameters
        assert stage.weights == parameters * 2  # bf16
        assert stage.grads == parameters * 4  # fp32 main grads
        assert stage.optimizer == parameters * 12  # DP 1: the distributed optimizer shards over one rank
    # the norms are the only whole tensors: weights are the stage's parameters / TP x 2 bytes to 0.02%
    middle_stage_parameters = 20 * 877_684_736
    assert result.stages[1].weights == pytest.approx(middle_stage_parameters / 8 * 2, rel=2e-4)


def test_optimizer_shards_divide_by_data_parallel_size():
    one = plan(QWEN72B, **RECIPE)
    four = plan(QWEN72B, **{**RECIPE, "dp": 4})
    for a, b in zip(one.stages, four.stages):
        assert b.optimizer == a.parameters * 12 // 4
        assert (b.weights, b.grads) == (a.weights, a.grads)
    unsharded = plan(QWEN72B, **{**RECIPE, "dp": 4}, distributed_optimizer=False)
    assert unsharded.stages[0].optimizer == one.stages[0].optimizer
    fp32 = plan(QWEN72B, **RECIPE, params_dtype="fp32")
    assert fp32.stages[0].optimizer == fp32.stages[0].parameters * 8  # no master copy: Adam's two moments
    assert fp32.stages[0].weights == fp32.stages[0].grads == fp32.stages[0].parameters * 4
    bf16_grads = plan(QWEN72B, **RECIPE, grad_reduce_in_fp32=False)
    assert bf16_grads.stages[0].grads == bf16_grads.stages[0].parameters * 2


@pytest.mark.parametrize("name", ["qwen2.5-tiny", "qwen2.5-0.5b", "gpt-tiny", "gpt-tiny-tied", "gpt-125m"])
def test_single_device_weights_are_the_whole_model(name):
    model = models.get(name)
    small = dict(tp=1, pp=1, dp=1, micro_batch_size=1, global_batch_size=1, seq_length=model.seq_length)
    assert plan(model, **small).stages[0].weights == model.num_parameters() * 2
    assert plan(model, **small, params_dtype="fp32").stages[0].weights == model.num_parameters() * 4


def test_pipeline_stages_add_up_to_the_model():
    stages = plan(QWEN72B, **{**RECIPE, "tp": 1, "vpp": None, "dp": 8}).stages
    assert sum(s.parameters for s in stages) == QWEN72B.num_parameters()


def _qwen72b_layer_bytes(tokens: int, tp: int = 8) -> float:
    """By hand, one layer and micro-batch, flash attention, no dropout, sequence parallel."""
    h, f, heads, groups, d = 8192, 29568, 64, 8, 128
    sequence_region = 4 * 2 * h  # two norm inputs, QKV and FC1 inputs
    attention = 2 * heads * d + 2 * 2 * groups * d + 2 * h + 4 * heads  # Q, K and V, output, log-sum-exp
    mlp = 2 * 2 * f + 2 * f  # SwiGLU input (FC1 output), FC2 input
    return tokens * (sequence_region + attention + mlp) / tp


def test_72b_activations_and_logits_by_hand():
    result = plan(QWEN72B, **RECIPE)
    tokens = 4096 * 2
    # interleaved 1F1B: rank r holds 2(p - r - 1) + (v - 1)p + 1 chunk passes of 4 layers
    assert [s.passes_in_flight for s in result.stages] == [23, 21, 19, 17]
    for stage in result.stages:
        assert stage.activations == round(stage.passes_in_flight * 4 * _qwen72b_layer_bytes(tokens))
    # stage 0 holds L (1 + (p - 1) / (p v)) = 92 layers' worth (Korthikanti et al. 2022, 4.2.3)
    assert result.stages[0].passes_in_flight * 4 == 80 * (1 + 3 / 20)
    h, vocab = 8192, 152064
    logits = tokens * (2 * 2 * h / 8 + (2 + 4) * vocab / 8)  # final norm + output inputs, bf16 + fp32 logits
    assert [s.logits for s in result.stages] == [0, 0, 0, round(logits)]
    assert result.peak.stage == 0
    assert result.stages[0].total == sum(getattr(result.stages[0], row) for row in
                                         ("weights", "grads", "optimizer", "activations", "logits"))


def test_paper_formula_for_a_gpt_layer():
    """MHA, GeLU with f = 4h, unfused attention, dropout: sbh(34 + 5as/h)/t per layer (eq. 4 of the paper),
    sbh(10 + 24/t + 5as/(ht)) without sequence parallelism (eq. 2), 34sbh/t with selective recompute."""
    model = models.get("gpt-1.3b")
    s, b, h, a, t = 2048, 4, model.hidden_size, model.num_attention_heads, 2
    assert model.ffn_hidden_size == 4 * h and model.activation == "gelu"
    layout = dict(tp=t, pp=1, dp=1, micro_batch_size=b, global_batch_size=b, seq_length=s, params_dtype="fp16",
                  flash_attention=False, hidden_dropout=0.1, attention_dropout=0.1)
    per_layer = plan(model, **layout).stages[0].activations / model.num_layers
    assert per_layer == pytest.approx(s * b * h * (34 + 5 * a * s / h) / t)
    no_sp = plan(model, **layout, sequence_parallel=False).stages[0].activations / model.num_layers
    assert no_sp == pytest.approx(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))
    selective = plan(model, **layout, recompute="selective").stages[0].activations / model.num_layers
    assert selective == pytest.approx(s * b * h * 34 / t)
    full = plan(model, **layout, recompute="full").stages[0].activations / model.num_layers
    assert full == pytest.approx(2 * s * b * h / t)  # each layer's input only


def test_recompute_orders_activation_memory():
    none, selective, full = (plan(QWEN72B, **RECIPE, recompute=mode).stages[0].activations
                             for mode in (None, "selective", "full"))
    assert full < selective < none
    block = plan(QWEN72B, **RECIPE, recompute="full", recompute_method="block", recompute_num_layers=2)
    assert full < block.stages[0].activations < none
    grouped = plan(QWEN72B, **RECIPE, recompute="full", recompute_num_layers=4)
    assert grouped.stages[0].activations * 4 == full  # one input per group of four layers


def test_flash_attention_keeps_no_scores():
    flash = plan(QWEN72B, **RECIPE).stages[0].activations
    unfused = plan(QWEN72B, **RECIPE, flash_attention=False).stages[0].activations
    assert unfused > 2 * flash  # the s x s scores dominate at seq 4096
    assert plan(QWEN72B, **RECIPE, flash_attention=False, recompute="selective").stages[0].activations < flash


def test_interleaving_holds_more_micro_batches_on_stage_0():
    layers, p = 80, 4
    one_f_one_b = plan(QWEN72B, **{**RECIPE, "vpp": None})
    assert [s.passes_in_flight * s.layers_per_pass for s in one_f_one_b.stages] == [80, 60, 40, 20]
    for v in (2, 5, 10):
        stage0 = plan(QWEN72B, **{**RECIPE, "vpp": v}).stages[0]
        assert stage0.passes_in_flight * stage0.layers_per_pass == layers * (1 + (p - 1) / (p * v))
        assert stage0.activations > one_f_one_b.stages[0].activations
    # with no more micro-batches than warmup passes, all of them are in flight
    assert passes_in_flight(4, 5, 0, num_microbatches=4) == 20
    assert passes_in_flight(4, None, 0, num_microbatches=2) == 2
    assert passes_in_flight(1, None, 0, num_microbatches=64) == 1


@pytest.mark.parametrize("change, error, message", [
    (dict(tp=3), ModelConfigError, "tensor parallel size 3 does not divide num_attention_heads=64"),
    (dict(vpp=3), ModelConfigError, "80 layers cannot be split evenly into 4 pipeline stages x 3 virtual"),
    (dict(global_batch_size=127), PlanError, "global batch 127 is not divisible by micro batch 2 x DP 1"),
    (dict(global_batch_size=4, micro_batch_size=2, dp=1), PlanError, "groups of PP 4"),
    (dict(pp=1, vpp=2), PlanError, "need a pipeline"),
    (dict(seq_length=4100), PlanError, "does not divide them"),
    (dict(dp=0), PlanError, "dp=0: must be a positive integer"),
])
def test_layout_errors(change, error, message):
    with pytest.raises(error, match=message):
        plan(QWEN72B, **{**RECIPE, **change})


def test_cli_table_and_ignored_arguments(capsys):
    assert memory_plan.main(["--world-size", "32", *RECIPE_ARGS, "--lr", "1e-5", "--data-path", "a", "b"]) == 0
    out = capsys.readouterr().out
    expected = plan(QWEN72B, **RECIPE)
    assert "TP 8 x PP 4 x DP 1 = 32 devices, 5 virtual stages of 4 layers" in out
    for row in ("weights", "grads", "optimizer", "activations", "logits", "total"):
        line = next(line for line in out.splitlines() if line.startswith(f"{row} (GiB)"))
        assert line.split()[2:] == [f"{s.gib()[row]:.2f}" for s in expected.stages]
    assert f"needs {expected.stages[0].total / 2**30:.1f} GiB per device (stage 0)" in out


def test_cli_world_size_from_the_environment(monkeypatch):
    monkeypatch.setenv("NNODES", "4")
    monkeypatch.setenv("NPROC_PER_NODE", "16")
    result, name = plan_from_args(RECIPE_ARGS)
    assert (name, result.dp, result.num_microbatches) == ("qwen2.5-72b", 2, 32)


@pytest.mark.parametrize("argv, message", [
    (["--world-size", "8", *RECIPE_ARGS], "error: world size 8 is not divisible by TP 8 x PP 4 x CP 1 = 32"),
    (["--world-size", "32", *RECIPE_ARGS, "--tensor-model-parallel-size", "3"],
     "error: tensor parallel size 3 does not divide"),
    (["--world-size", "32", *RECIPE_ARGS, "--num-layers-per-virtual-pipeline-stage", "3"],
     "error: 80 layers over PP 4 cannot be cut into virtual stages of 3 layers"),
    (["--world-size", "32", "--model", "qwen9"], "error: unknown model 'qwen9'"),
])
def test_cli_errors_are_one_line(argv, message, capsys):
    assert memory_plan.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1


def _script_env(tmp_path: Path, **extra: str) -> dict:
    """The environment of a fresh shell: no paths or sizes from this one, and a torchrun that only records."""
    env = {k: v for k, v in os.environ.items()
           if k not in {"DATA_PATH", "TOKENIZER_MODEL", "CKPT_LOAD_DIR", "CKPT_SAVE_DIR", "TENSORBOARD_DIR",
                        "NNODES", "NODE_RANK", "NPROC_PER_NODE", "MASTER_ADDR", "MASTER_PORT", "DRY_RUN",
                        "EXTRA_ARGS", "TRAIN_ITERS", "ADAPTER_BACKEND"}}
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "torchrun"
    fake.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > "{tmp_path}/torchrun-args"\nenv > "{tmp_path}/torchrun-env"\n')
    fake.chmod(0o755)
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", PYTHON=sys.executable, **extra)
    return env


def _run_script(env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_dry_run_prints_command_and_plan(tmp_path):
    done = _run_script(_script_env(tmp_path, DRY_RUN="1"))
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "--tensor-model-parallel-size 8" in out and "--pipeline-model-parallel-size 4" in out
    assert "--num-layers-per-virtual-pipeline-stage 4" in out and "--model qwen2.5-72b" in out
    assert "torchrun \\\n    --nnodes 4 \\\n" in out and "HCCL_CONNECT_TIMEOUT=1800" in out
    expected = plan(QWEN72B, **RECIPE)
    for row in ("weights", "grads", "optimizer", "activations"):
        line = next(line for line in out.splitlines() if line.startswith(f"{row} (GiB)"))
        assert line.split()[2:] == [f"{s.gib()[row]:.2f}" for s in expected.stages]
    assert "not launched" in out
    assert not (tmp_path / "torchrun-args").exists()


@pytest.mark.slow
def test_missing_data_path_fails_before_launching(tmp_path):
    done = _run_script(_script_env(tmp_path, TOKENIZER_MODEL="/models/qwen"))
    assert done.returncode != 0
    assert done.stderr.startswith("error: set DATA_PATH") and done.stderr.count("\n") == 1
    assert not (tmp_path / "torchrun-args").exists()


@pytest.mark.slow
def test_launch_passes_the_environment_to_torchrun(tmp_path):
    env = _script_env(tmp_path, DATA_PATH="0.3 /data/a 0.7 /data/b", TOKENIZER_MODEL="/models/qwen",
                      CKPT_SAVE_DIR="/ckpt/out", NODE_RANK="2", MASTER_ADDR="10.0.0.1", EXTRA_ARGS="--train-iters 5",
                      HCCL_CONNECT_TIMEOUT="600")
    done = _run_script(env)
    assert done.returncode == 0, done.stderr
    argv = (tmp_path / "torchrun-args").read_text().split("\n")[:-1]
    command = " ".join(argv)
    assert command.startswith("--nnodes 4 --node_rank 2 --nproc_per_node 8 --master_addr 10.0.0.1 "
                              f"--master_port 6000 {ROOT / 'scripts' / 'pretrain_gpt.py'} --model qwen2.5-72b ")
    assert "--data-path 0.3 /data/a 0.7 /data/b --split" in command
    assert "--tokenizer-model /models/qwen" in command and "--save /ckpt/out --save-interval 2000" in command
    assert "--load" not in argv and command.endswith("--train-iters 5")
    assert "memory plan per device" in done.stdout  # checked before launching
    launched_env = dict(line.split("=", 1) for line in (tmp_path / "torchrun-env").read_text().splitlines()
                        if "=" in line)
    assert launched_env["HCCL_CONNECT_TIMEOUT"] == "600"  # the caller's value wins over the default
    assert launched_env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1" and "ADAPTER_BACKEND" not in launched_env


# Qwen2-57B-A14B (huggingface.co/Qwen/Qwen2-57B-A14B config.json): 64 experts of FFN 2560, top 8, a gated
# shared expert of 20480, every layer MoE
QWEN2_57B = ModelConfig(num_layers=28, hidden_size=3584, ffn_hidden_size=18944, num_attention_heads=28,
                        num_query_groups=4, vocab_size=151936, max_position_embeddings=131072, seq_length=4096,
                        norm_epsilon=1e-6, rotary_base=1e6, add_qkv_bias=True, num_experts=64,
                        moe_ffn_hidden_size=2560, moe_router_topk=8, moe_shared_expert_intermediate_size=20480,
                        moe_shared_expert_gate=True, moe_router_pre_softmax=True)
# 32 devices: TP2 x PP4 x DP4 for the dense part, EP4 x expert DP2 for the experts
MOE_LAYOUT = dict(tp=2, pp=4, dp=4, ep=4, etp=1, micro_batch_size=1, global_batch_size=64, seq_length=4096)


def test_moe_57b_is_the_published_size():
    assert QWEN2_57B.num_parameters() == pytest.approx(57.41e9, rel=1e-4)


def test_moe_weights_grads_optimizer_by_hand():
    """Per layer by hand: attention, shared expert split over TP 2; norms, router and shared-expert gate
    whole; 64 experts over EP 4, 16 per device; Adam's 12 bytes over DP 4, the experts' over expert DP 2."""
    h, qkv, experts, vocab = 3584, (28 + 2 * 4) * 128, 64, 151936
    split = qkv * h + qkv + h * h + 3 * 20480 * h
    whole = 2 * h + experts * h + h
    routed = experts * 3 * 2560 * h
    result = plan(QWEN2_57B, **MOE_LAYOUT)
    for stage in result.stages:
        first, last = stage.stage == 0, stage.stage == 3
        local_experts = 7 * routed // 4
        parameters = (7 * split + vocab * h * (first + last)) // 2 + 7 * whole + h * last + local_experts
        assert (stage.parameters, stage.expert_parameters) == (parameters, local_experts)
        assert (stage.weights, stage.grads) == (parameters * 2, parameters * 4)
        assert stage.optimizer == (parameters - local_experts) * 12 // 4 + local_experts * 12 // 2
    assert sum(s.expert_parameters for s in result.stages) * 4 == 28 * routed  # every expert on one EP rank


def test_moe_activations_by_hand():
    """One MoE layer per token, flash attention, sequence parallel over t = 2: the router's fp32 logits and
    scores with the sequence region; each token's 8 copies in the dispatcher's permuted tokens (h each) and
    what each expert's SwiGLU keeps (3 x 2560 each); the shared expert's SwiGLU."""
    e, h, a, g, d, t = 2, 3584, 28, 4, 128, 2
    sequence_region = 4 * e * h + 8 * 64
    attention = e * (a * d + 2 * g * d) + e * h + 4 * a
    moe = 8 * (e * h + 3 * e * 2560) + 3 * e * 20480
    layer = 4096 * (sequence_region + attention + moe) / t
    result = plan(QWEN2_57B, **MOE_LAYOUT)
    assert [s.passes_in_flight for s in result.stages] == [4, 3, 2, 1]
    for stage in result.stages:
        assert stage.activations == round(stage.passes_in_flight * 7 * layer)


def test_moe_layers_per_stage_follow_the_pattern():
    alternating = QWEN2_57B.replace(moe_layer_freq=(0, 1) * 14)
    one_f_one_b = plan(alternating, **MOE_LAYOUT)
    routed_layer = 64 * 3 * 2560 * 3584 // 4
    assert [s.expert_parameters for s in one_f_one_b.stages] == [3 * routed_layer, 4 * routed_layer,
                                                                 3 * routed_layer, 4 * routed_layer]
    # 7 virtual stages of one layer: pipeline rank r holds layers r, r + 4, ..., all dense on even ranks
    interleaved = plan(alternating, **MOE_LAYOUT, vpp=7)
    assert [s.expert_parameters for s in interleaved.stages] == [0, 7 * routed_layer, 0, 7 * routed_layer]
    dense, moe = interleaved.stages[0], interleaved.stages[1]
    assert moe.activations / moe.passes_in_flight > dense.activations / dense.passes_in_flight


@pytest.mark.parametrize("change, error, message", [
    (dict(ep=3), ModelConfigError, "expert parallel size 3 does not divide num_experts=64"),
    (dict(ep=16), PlanError, "the 8 devices of a pipeline stage (TP 2 x DP 4 x CP 1) are not divisible by expert "
                             "TP 1 x EP 16"),
    (dict(etp=3, ep=1), ModelConfigError, "expert tensor parallel size 3 does not divide expert_ffn_hidden_size"),
])
def test_moe_layout_errors(change, error, message):
    with pytest.raises(error, match=re.escape(message)):
        plan(QWEN2_57B, **{**MOE_LAYOUT, **change})


MOE_ARGS = ["--num-layers", "28", "--hidden-size", "3584", "--ffn-hidden-size", "18944", "--num-attention-heads", "28",
            "--group-query-attention", "--num-query-groups", "4", "--vocab-size", "151936", "--seq-length", "4096",
            "--max-position-embeddings", "131072", "--norm-epsilon", "1e-6", "--rotary-base", "1e6", "--swiglu",
            "--disable-bias-linear", "--add-qkv-bias", "--num-experts", "64", "--moe-ffn-hidden-size", "2560",
            "--moe-router-topk", "8", "--moe-shared-expert-intermediate-size", "20480", "--moe-shared-expert-gate",
            "--moe-router-pre-softmax", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "4",
            "--expert-model-parallel-size", "4", "--expert-tensor-parallel-size", "1", "--sequence-parallel",
            "--bf16", "--use-distributed-optimizer", "--use-flash-attn", "--micro-batch-size", "1",
            "--global-batch-size", "64", "--hidden-dropout", "0", "--attention-dropout", "0"]


def test_cli_moe_table(capsys):
    assert memory_plan.main(["--world-size", "32", *MOE_ARGS]) == 0
    out = capsys.readouterr().out
    expected = plan(QWEN2_57B, **MOE_LAYOUT)
    assert "experts: EP 4 x expert TP 1 x expert DP 2, 16 of 64 per device" in out
    assert "distributed optimizer over 4 ranks (experts over 2)" in out
    line = next(line for line in out.splitlines() if line.startswith("of which experts (M)"))
    assert line.split()[4:] == [f"{s.expert_parameters / 1e6:.1f}" for s in expected.stages]
    for row in ("weights", "optimizer", "activations", "total"):
        line = next(line for line in out.splitlines() if line.startswith(f"{row} (GiB)"))
        assert line.split()[2:] == [f"{s.gib()[row]:.2f}" for s in expected.stages]


def test_cli_moe_world_size_error(capsys):
    assert memory_plan.main(["--world-size", "32", *MOE_ARGS, "--expert-model-parallel-size", "16"]) == 2
    assert capsys.readouterr().err.startswith(
        "error: world size 32 is not divisible by expert TP 1 x EP 16 x PP 4 = 64")

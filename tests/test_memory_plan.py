"""The per-device memory plan against hand calculations (Qwen3's heads of their own size and QK-norm
included), the model-FLOPs count behind TFLOP/s, and the launchers' dry runs (Qwen2.5-72B; Qwen3-8B,
-30B-A3B and -235B-A22B)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import models
from flow import memory_plan, model_flags
from flow.memory_plan import PlanError, passes_in_flight, plan, plan_from_args
from models.config import ModelConfig, ModelConfigError

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "pretrain_qwen_72b.sh"
QWEN72B = models.get("qwen2.5-72b")
# MindSpeed-LLM's 4k recipe layout: 4 nodes x 8 devices (the launcher runs it at micro-batch 1, LAUNCHER_4K)
RECIPE = dict(tp=8, pp=4, vpp=5, dp=1, micro_batch_size=2, global_batch_size=128, seq_length=4096)
LAUNCHER_4K = {**RECIPE, "micro_batch_size": 1}
RECIPE_ARGS = ["--model", "qwen2.5-72b", "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "4",
               "--num-layers-per-virtual-pipeline-stage", "4", "--sequence-parallel", "--bf16",
               "--use-distributed-optimizer", "--use-flash-attn", "--micro-batch-size", "2",
               "--global-batch-size", "128", "--seq-length", "4096", "--hidden-dropout", "0.0",
               "--attention-dropout", "0.0", "--eval-interval", "1000"]


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


@pytest.mark.parametrize("name", models.names())
def test_single_device_weights_are_the_whole_model(name):
    """Every named config, Qwen3's heads of 128 against hidden / heads and QK-norm included, and the hybrid
    ones' Gated DeltaNet layers."""
    model = models.get(name)
    small = dict(tp=1, pp=1, dp=1, micro_batch_size=1, global_batch_size=1, seq_length=model.seq_length)
    assert sum(s.parameters for s in plan(model, **small).stages) == model.num_parameters()
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
    (dict(tp=3), PlanError, "tensor parallel size 3 does not divide num_attention_heads=64"),
    (dict(vpp=3), PlanError, r"80 layers cannot be split evenly over pipeline \(4\) x virtual pipeline \(3\) = 12"),
    (dict(global_batch_size=127), PlanError, "global batch 127 is not divisible by micro batch 2 x DP 1"),
    (dict(global_batch_size=4, micro_batch_size=2, dp=1), PlanError, "groups of PP 4"),
    (dict(pp=1, vpp=2), PlanError, "virtual pipeline size 2 needs pipeline_model_parallel_size > 1"),
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
    (["--world-size", "8", *RECIPE_ARGS],
     "error: world_size=8: world size (8) is not divisible by total_model_size (total_model_size=32)"),
    (["--world-size", "32", *RECIPE_ARGS, "--tensor-model-parallel-size", "3"],
     "error: world_size=32: world size (32) is not divisible by total_model_size (total_model_size=12)"),
    (["--world-size", "24", *RECIPE_ARGS, "--tensor-model-parallel-size", "3"],
     "error: tensor parallel size 3 does not divide num_attention_heads=64"),
    (["--world-size", "32", *RECIPE_ARGS, "--num-layers-per-virtual-pipeline-stage", "3"],
     "error: --num-layers-per-virtual-pipeline-stage 3: number of layers per pipeline stage must be divisible"),
    (["--world-size", "32", "--model", "qwen9"], "error: --model qwen9: unknown model 'qwen9'"),
    (["--world-size", "32", *RECIPE_ARGS, "--rotary-base", "1e6"],
     "error: argument --rotary-base: invalid int value: '1e6'"),
])
def test_cli_errors_are_one_line(argv, message, capsys):
    """megatron.training's own refusals, as the run would say them (the world size, the virtual stages), and the
    plan's where megatron leaves a layout to the model's build (heads over TP)."""
    assert memory_plan.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1


def _script_env(tmp_path: Path, **extra: str) -> dict:
    """The environment of a fresh shell: no paths or sizes from this one, and a torchrun that only records (the
    launch's TORCHRUN, where a test asks for it)."""
    env = {k: v for k, v in os.environ.items()
           if k not in {"DATA_PATH", "TOKENIZER_MODEL", "CKPT_LOAD_DIR", "CKPT_SAVE_DIR", "TENSORBOARD_DIR",
                        "NNODES", "NODE_RANK", "NPROC_PER_NODE", "MASTER_ADDR", "MASTER_PORT", "DRY_RUN",
                        "MAX_RESTARTS", "RDZV_ID", "TORCHRUN",
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
    assert f"{sys.executable} {ROOT}/scripts/launch.py \\\n    --nnodes 4 \\\n" in out
    assert "HCCL_CONNECT_TIMEOUT=1800" in out
    assert "    --rdzv-backend c10d \\\n    --rdzv-endpoint localhost:6000 \\\n" in out
    assert "    --max-restarts 3 \\\n" in out
    expected = plan(QWEN72B, **LAUNCHER_4K)
    for row in ("weights", "grads", "optimizer", "activations"):
        line = next(line for line in out.splitlines() if line.startswith(f"{row} (GiB)"))
        assert line.split()[2:] == [f"{s.gib()[row]:.2f}" for s in expected.stages]
    assert "not launched" in out
    assert not (tmp_path / "torchrun-args").exists()


# a 64 GB device holds 59.6 GiB; the plan leaves at least this much of it to the runtime, the communicators'
# buffers and fragmentation
DEVICE_GIB, HEADROOM_GIB = 64e9 / 2**30, 7.5


@pytest.mark.slow
@pytest.mark.parametrize("seq_length, layout", [
    ("4096", "TP 8 x PP 4 x DP 1 = 32 devices, 5 virtual stages of 4 layers"),
    ("32768", "TP 8 x PP 4 x DP 1 x CP 4 = 128 devices"),
])
def test_72b_dry_runs_print_a_command_the_flow_accepts_and_a_plan_that_fits(tmp_path, seq_length, layout):
    """SEQ_LENGTH picks MindSpeed-LLM's 4k or 32k layout (CP 4, ring attention); each command is one the flow
    accepts at its world size, and its stage 0 fits a 64 GB device with room to spare."""
    for suffix in (".bin", ".idx"):
        (tmp_path / f"corpus{suffix}").touch()
    done = _run_script(_script_env(tmp_path, DRY_RUN="1", SEQ_LENGTH=seq_length, DATA_PATH=str(tmp_path / "corpus"),
                                   TOKENIZER_MODEL=str(tmp_path)))
    assert done.returncode == 0, done.stderr
    command = _printed_command(done.stdout)
    argv = command[command.index(str(ROOT / "scripts" / "pretrain_gpt.py")) + 1:]
    world = int(command[command.index("--nnodes") + 1]) * int(command[command.index("--nproc_per_node") + 1])
    args = memory_plan.megatron_args(argv, world)
    assert (args.seq_length, args.data_parallel_size) == (int(seq_length), 1)
    expected, _ = plan_from_args(["--world-size", str(world), *argv])
    assert f"memory plan per device: qwen2.5-72b, {layout}" in done.stdout
    peak = re.search(r"needs ([\d.]+) GiB per device \(stage (\d+)\)", done.stdout)
    assert (float(peak.group(1)), int(peak.group(2))) == (round(expected.peak.total / 2**30, 1), 0)
    assert expected.peak.total / 2**30 < DEVICE_GIB - HEADROOM_GIB, done.stdout
    if seq_length == "32768":
        assert (args.context_parallel_size, args.cp_comm_type, expected.cp) == (4, ["p2p"], 4)  # megatron: per layer
        # activations of 32k tokens split over CP 4 are those of 8k tokens on one rank
        unsplit_8k = plan(QWEN72B, tp=8, pp=4, dp=4, micro_batch_size=1, global_batch_size=128, seq_length=8192)
        assert expected.peak.activations == unsplit_8k.peak.activations


def test_context_parallel_splits_the_sequence_in_2cp_chunks():
    with pytest.raises(PlanError, match=r"seq_length=4098 is not divisible by 2 x context parallel size 2 = 4"):
        plan(QWEN72B, **{**RECIPE, "seq_length": 4098}, cp=2)


@pytest.mark.slow
def test_missing_data_path_fails_before_launching(tmp_path):
    done = _run_script(_script_env(tmp_path, TOKENIZER_MODEL="/models/qwen"))
    assert done.returncode != 0
    assert done.stderr.startswith("error: set DATA_PATH") and done.stderr.count("\n") == 1
    assert not (tmp_path / "torchrun-args").exists()


@pytest.mark.slow
def test_launch_passes_the_environment_to_torchrun(tmp_path):
    env = _script_env(tmp_path, TORCHRUN=str(tmp_path / "bin" / "torchrun"), DATA_PATH="0.3 /data/a 0.7 /data/b",
                      TOKENIZER_MODEL="/models/qwen", CKPT_SAVE_DIR="/ckpt/out", NODE_RANK="2", MASTER_ADDR="10.0.0.1",
                      EXTRA_ARGS="--train-iters 5", HCCL_CONNECT_TIMEOUT="600")
    done = _run_script(env)
    assert done.returncode == 0, done.stderr
    argv = (tmp_path / "torchrun-args").read_text().split("\n")[:-1]
    command = " ".join(argv)
    assert command.startswith("--nnodes 4 --node_rank 2 --nproc_per_node 8 --rdzv-backend c10d --rdzv-endpoint "
                              "10.0.0.1:6000 --rdzv-id pretrain-10.0.0.1-6000 --max-restarts 3 "
                              f"{ROOT / 'scripts' / 'pretrain_gpt.py'} --model qwen2.5-72b ")
    assert "--data-path 0.3 /data/a 0.7 /data/b --split" in command
    assert "--tokenizer-model /models/qwen" in command and "--save /ckpt/out --save-interval 2000" in command
    assert "--load" not in argv and command.endswith("--save-interval 2000 --train-iters 5")
    assert "--distributed-timeout-minutes 30 --exit-signal-handler " in command
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
    (dict(ep=3), PlanError, "expert parallel size 3 does not divide num_experts=64"),
    (dict(ep=16), PlanError, "is not divisible by expert tensor (1) x expert (16) x pipeline"),
    (dict(etp=3, ep=1), PlanError, "expert tensor parallel size 3 does not divide expert_ffn_hidden_size"),
])
def test_moe_layout_errors(change, error, message):
    with pytest.raises(error, match=re.escape(message)):
        plan(QWEN2_57B, **{**MOE_LAYOUT, **change})


MOE_ARGS = ["--num-layers", "28", "--hidden-size", "3584", "--ffn-hidden-size", "18944", "--num-attention-heads", "28",
            "--group-query-attention", "--num-query-groups", "4", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "151936", "--padded-vocab-size", "151936", "--seq-length", "4096",
            "--max-position-embeddings", "131072", "--norm-epsilon", "1e-6",
            "--position-embedding-type", "rope", "--rotary-base", "1000000", "--swiglu",
            "--disable-bias-linear", "--add-qkv-bias", "--num-experts", "64", "--moe-ffn-hidden-size", "2560",
            "--moe-router-topk", "8", "--moe-shared-expert-intermediate-size", "20480", "--moe-shared-expert-gate",
            "--moe-router-pre-softmax", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "4",
            "--expert-model-parallel-size", "4", "--expert-tensor-parallel-size", "1", "--sequence-parallel",
            "--bf16", "--use-distributed-optimizer", "--use-flash-attn", "--micro-batch-size", "1",
            "--global-batch-size", "64", "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-interval", "1000"]


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
        "error: world size 32 is not divisible by expert tensor (1) x expert (16) x pipeline (4) parallel = 64")


# Qwen3-0.6B (huggingface.co/Qwen/Qwen3-0.6B-Base config.json): 16 heads of 128, 2048 wide against a hidden
# size of 1024, 8 query groups, QK-norm, tied embeddings
QWEN3_06B = models.get("qwen3-0.6b")


def _qwen3_06b_layer_parameters() -> tuple[int, int]:
    """By hand: (split over TP, whole) parameters of one Qwen3-0.6B layer. QKV rows (16 + 2 x 8) x 128, the
    output projection 2048 -> 1024 (not 1024 x 1024), SwiGLU of 3072; two RMSNorms of 1024, two QK-norms
    of 128."""
    h, f, heads, groups, d = 1024, 3072, 16, 8, 128
    split = (heads + 2 * groups) * d * h + heads * d * h + 3 * f * h
    return split, 2 * h + 2 * d


def test_qwen3_06b_is_the_published_size_by_hand():
    split, whole = _qwen3_06b_layer_parameters()
    by_hand = 28 * (split + whole) + 151936 * 1024 + 1024  # layers, tied embedding, final norm
    single = plan(QWEN3_06B, tp=1, pp=1, dp=1, micro_batch_size=1, global_batch_size=1, seq_length=4096)
    assert single.stages[0].parameters == by_hand == QWEN3_06B.num_parameters() == 596_049_920
    # TP 2 x PP 2: the layers' matrices and the (tied, so twice held) embedding halve, the norms stay whole
    stages = plan(QWEN3_06B, tp=2, pp=2, dp=1, micro_batch_size=1, global_batch_size=2, seq_length=4096).stages
    assert [s.parameters for s in stages] == [(14 * split + 151936 * 1024) // 2 + 14 * whole,
                                              (14 * split + 151936 * 1024) // 2 + 14 * whole + 1024]


@pytest.mark.parametrize("name, layout", [
    ("qwen3-8b", dict(tp=2, pp=4)),
    ("qwen3-32b", dict(tp=8, pp=8, vpp=2)),
    ("qwen3-30b-a3b", dict(tp=1, pp=4)),
    ("qwen3-235b-a22b", dict(tp=4, pp=2)),
])
def test_qwen3_tp_shares_and_stages_add_up_to_the_model(name, layout):
    """Over TP ranks and pipeline stages (untied models: nothing held twice), every parameter once: all but
    the norms, QK-norms and routers split over TP (the experts over expert TP, which defaults to TP)."""
    model = models.get(name)
    result = plan(model, **layout, dp=1, micro_batch_size=1, global_batch_size=16, seq_length=4096)
    h, d = model.hidden_size, model.head_dim
    whole = model.num_layers * (2 * h + 2 * d + (model.num_experts or 0) * h) + h  # and the final norm
    assert (sum(s.parameters for s in result.stages) - whole) * layout["tp"] + whole == model.num_parameters()


def _qwen3_layer_bytes(tokens: int, tp: int) -> float:
    """By hand, one Qwen3-0.6B layer and micro-batch, flash attention, no dropout, sequence parallel: the
    attention width is 16 x 128 = 2048, twice the hidden size."""
    e, h, f, a, g, d = 2, 1024, 3072, 16, 8, 128
    sequence_region = 4 * e * h  # two norm inputs, QKV and FC1 inputs
    attention = e * (a * d + 2 * g * d) + e * a * d + 4 * a  # Q, K, V; the output (a x d wide); log-sum-exp
    qk_norms = e * (a + g) * d + 4 * (a + g)  # the un-normed Q and K, each head's fp32 reciprocal RMS
    mlp = 3 * e * f
    return tokens * (sequence_region + attention + qk_norms + mlp) / tp


def test_qwen3_activations_by_hand():
    result = plan(QWEN3_06B, tp=2, pp=2, dp=1, micro_batch_size=2, global_batch_size=8, seq_length=4096)
    assert [s.passes_in_flight for s in result.stages] == [2, 1]
    for stage in result.stages:
        assert stage.activations == round(stage.passes_in_flight * 14 * _qwen3_layer_bytes(2 * 4096, tp=2))
    # QK-norm's inputs stay with selective recompute: it checkpoints core attention only
    selective = plan(QWEN3_06B, tp=2, pp=2, dp=1, micro_batch_size=2, global_batch_size=8, seq_length=4096,
                     recompute="selective").stages[1]
    assert selective.activations == round(14 * (_qwen3_layer_bytes(2 * 4096, tp=2) - 2 * 4096 * 4 * 16 / 2))


def test_model_flops_of_a_separate_head_size():
    """PaLM's count: 6 x the matmul parameters a token passes through plus 12 x layers x seq x heads x
    head size; Qwen3-0.6B's attention is 2048 wide, so the projection is 2048 x 1024 and the score and value
    products 2048 wide. The 30B-A3B's tokens pass through 8 of its 128 experts."""
    from flow.model_flops import model_flops_per_token

    split, _ = _qwen3_06b_layer_parameters()
    assert model_flops_per_token(QWEN3_06B, 4096) == 6 * (28 * split + 151936 * 1024) + 12 * 28 * 4096 * 2048
    moe = models.get("qwen3-30b-a3b")
    h, attention = 2048, (32 + 2 * 4) * 128 * 2048 + 32 * 128 * 2048
    matmuls = 48 * (attention + 8 * 3 * 768 * h) + 151936 * h
    assert model_flops_per_token(moe, 4096) == 6 * matmuls + 12 * 48 * 4096 * 32 * 128


# the Qwen3 launchers: (script, its layout: TP, PP, EP, devices). The plan leaves out the runtime's own
# memory (CANN / CUDA context and kernels' workspaces), communicator buffers and fragmentation: each layout
# keeps 8 GiB of a 64 GB device for them.
QWEN3_SCRIPTS = {
    "qwen3-8b": ("pretrain_qwen3_8b.sh", dict(tp=2, pp=2, ep=1, devices=8)),
    "qwen3-30b-a3b": ("pretrain_qwen3_30b_a3b.sh", dict(tp=1, pp=4, ep=4, devices=16)),
    "qwen3-235b-a22b": ("pretrain_qwen3_235b_a22b.sh", dict(tp=2, pp=2, ep=64, devices=256)),
    "qwen3.5-9b": ("pretrain_qwen35_9b.sh", dict(tp=2, pp=2, ep=1, devices=8)),
    "qwen3.5-397b-a17b": ("pretrain_qwen35_397b_a17b.sh", dict(tp=2, pp=4, ep=32, devices=256)),
}
DEVICE_BYTES, RESERVE = 64 * 10**9, 8 * 2**30


def _printed_command(out: str) -> list[str]:
    """The DRY_RUN block after 'command (...):' up to the blank line, which pastes back into a shell."""
    block = out.split("command (DRY_RUN=1: not launched):\n", 1)[1].split("\n\n", 1)[0]
    return shlex.split(block.replace("\\\n", " "))


def dry_run(tmp_path: Path, script: str, name: str, layout: dict):
    """A launcher's DRY_RUN: (its output, the plan of the command it printed). Checks that nothing launched,
    that the flow takes every argument of the command and that its model, layout and world are ``layout``'s."""
    for suffix in (".bin", ".idx"):
        (tmp_path / f"corpus{suffix}").touch()
    env = _script_env(tmp_path, DRY_RUN="1", DATA_PATH=str(tmp_path / "corpus"), TOKENIZER_MODEL=str(tmp_path))
    done = subprocess.run(["bash", str(ROOT / "scripts" / script)], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "torchrun-args").exists()
    command = _printed_command(done.stdout)
    argv = command[command.index(str(ROOT / "scripts" / "pretrain_gpt.py")) + 1:]
    world = int(command[command.index("--nnodes") + 1]) * int(command[command.index("--nproc_per_node") + 1])
    args = memory_plan.megatron_args(argv, world)  # every argument is one the flow's parser takes, and they fit
    assert (model_flags.name(argv), args.seq_length, world) == (name, 4096, layout["devices"])
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
            args.expert_model_parallel_size) == (layout["tp"], layout["pp"], layout["ep"])
    return done, args, plan_from_args(["--world-size", str(world), *argv])[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(QWEN3_SCRIPTS))
def test_qwen3_dry_run_prints_a_command_the_flow_accepts_and_a_plan_that_fits(tmp_path, name):
    script, layout = QWEN3_SCRIPTS[name]
    done, _, expected = dry_run(tmp_path, script, name, layout)
    total = next(line for line in done.stdout.splitlines() if line.startswith("total (GiB)"))
    assert total.split()[2:] == [f"{s.gib()['total']:.2f}" for s in expected.stages]
    peak = re.search(r"needs ([\d.]+) GiB per device \(stage (\d+)\)", done.stdout)
    assert (float(peak.group(1)), int(peak.group(2))) == (round(expected.peak.total / 2**30, 1), expected.peak.stage)
    assert expected.peak.total < DEVICE_BYTES - RESERVE
    if layout["ep"] > 1:
        experts = models.get(name).num_experts
        assert f"{experts // layout['ep']} of {experts} per device" in done.stdout

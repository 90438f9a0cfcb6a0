"""The one flow (scripts/pretrain_gpt.py: megatron.training's pretrain) end to end on gloo ranks: training
lowers the loss, a resumed run continues the uninterrupted loss curve exactly, and a run resumes at another
layout. The bad-argument table is tests/test_flow_arguments.py; saves that are killed or fail,
tests/test_checkpoint_safety.py."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import pytest
from packaging.version import Version

from adapter.registry import installed_megatron_core_version
from tests.conftest import DOUBLES
from tests.distributed import ROOT, run_ranks
from tests.flow_ranks import logged_losses as _losses
from tests.flow_ranks import run_pretrain, stopped_at

pytestmark = pytest.mark.multiproc


def _argv(iters: int, tp: int = 1, pp: int = 1, *extra: str, model: str = "qwen2.5-tiny") -> list[str]:
    return ["--model", model, "--tensor-model-parallel-size", str(tp),
            "--pipeline-model-parallel-size", str(pp), "--micro-batch-size", "2", "--global-batch-size", "8",
            "--seq-length", "32", "--train-iters", str(iters), "--lr", "3e-3", "--min-lr", "3e-4",
            "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--mock-data", "--log-interval", "1",
            "--eval-interval", "1000", "--eval-iters", "0", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--use-distributed-optimizer", "--ddp-bucket-size", "4096", "--seed", "7", *extra]


def pretrain_and_list_imports(argv: list[str]) -> dict:
    result = run_pretrain(argv)
    return {**result, "modules": sorted(sys.modules)}


STARTUP_LINE = re.compile(r"\[adapter\] time from launch to the end of the first iteration: ([0-9.]+) s \((.*)\)$")


def _startup(line: str) -> tuple[float, dict[str, float]]:
    """The start-up line's total and its phases (adapter/startup_clock.py's format)."""
    total, parts = STARTUP_LINE.match(line).groups()
    phases = {name: float(seconds) for name, seconds in re.findall(r"([a-z, ]+?) ([0-9.]+) s(?:, |$)", parts)}
    return float(total), phases


@pytest.fixture(scope="module")
def short_run() -> dict:
    """3 iterations of a mock-data run on one rank: what it printed and the modules it imported."""
    [result] = run_ranks(1, pretrain_and_list_imports, _argv(3))
    return result


@pytest.mark.megatron_training
def test_the_launch_reports_its_time_to_the_first_iteration_by_phase(short_run):
    """One line, printed once after the first iteration, counted from the process's start: the phases add
    up to the total the line shows (each rounded to 0.1 s). In a rank's process, which the test's launcher
    forks after the imports, megatron's entry timestamps give the phases from pretrain's entry on."""
    lines = [line for line in short_run["stdout"].splitlines() if "time from launch" in line]
    assert len(lines) == 1, short_run["stdout"][-3000:]
    total, phases = _startup(lines[0])
    assert list(phases) == ["setup", "initialize, model and data", "first iteration"], lines[0]
    assert all(seconds >= 0 for seconds in phases.values())
    assert total == pytest.approx(sum(phases.values()), abs=0.05 * (len(phases) + 1))


@pytest.mark.megatron_training
def test_a_mock_data_run_imports_no_hugging_face_code(short_run):
    assert "transformers" not in short_run["modules"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """TP2 x PP2 on 4 ranks, 12 iterations, saving every 6: the reference curve, and its checkpoints (a save
    leaves the curve as it is: the resumed runs below continue it bit for bit). The distributed optimizer's
    state is saved fully reshardable, Megatron-LM's way to resume it at another TP x PP."""
    saved = tmp_path_factory.mktemp("uninterrupted")
    saving = ("--save", str(saved), "--save-interval", "6", "--dist-ckpt-optim-fully-reshardable")
    return _losses(run_ranks(4, run_pretrain, _argv(12, 2, 2, *saving))), saved


@pytest.mark.slow
@pytest.mark.megatron_training
def test_tiny_qwen_trains_and_the_loss_falls(uninterrupted):
    curve, _ = uninterrupted
    assert sorted(curve) == list(range(1, 13))
    assert curve[12] < curve[1] - 0.3


@pytest.mark.slow
@pytest.mark.megatron_training
def test_resume_continues_the_uninterrupted_curve_bit_exactly(uninterrupted, tmp_path):
    # the same --train-iters (it sets the LR schedule and the dataset's sample order), from iteration 6
    curve, saved = uninterrupted
    resumed = _losses(run_ranks(4, run_pretrain, _argv(12, 2, 2, "--load", str(stopped_at(saved, 6, tmp_path)))))
    assert resumed == {i: curve[i] for i in range(7, 13)}


@pytest.mark.slow
@pytest.mark.megatron_training
def test_resume_at_another_layout_continues_the_curve(uninterrupted, tmp_path):
    """Saved at TP2 x PP2 (4 ranks), resumed at TP1 x DP2 (2 ranks): same data order, same weights and
    optimizer state, so the same losses up to reduction order."""
    curve, saved = uninterrupted
    resumed = _losses(run_ranks(2, run_pretrain, _argv(12, 1, 1, "--load", str(stopped_at(saved, 6, tmp_path)))))
    assert sorted(resumed) == list(range(7, 13))
    for i in range(7, 13):
        assert resumed[i] == pytest.approx(curve[i], abs=2e-4)


@pytest.mark.slow
@pytest.mark.megatron_training
@pytest.mark.xfail(Version(installed_megatron_core_version()) < Version("0.18"), strict=True,
                   reason="on megatron-core 0.17.1 the one flow's interleaved-pipeline run resumed at iteration 3 is "
                          "off its own curve (6.0386 against 6.1028 at iteration 4); 0.18.2 and 0.19.2 resume it "
                          "bit for bit. Not yet explained")
def test_interleaved_pipeline_trains_and_resumes_bit_exactly(tmp_path):
    """PP2 with two virtual stages of one layer each (the 72B recipe's schedule, in small)."""
    vpp = ("--num-layers-per-virtual-pipeline-stage", "1")
    saved = tmp_path / "saved"
    reference = _losses(run_ranks(2, run_pretrain, _argv(6, 1, 2, *vpp, "--save", str(saved), "--save-interval", "3")))
    assert reference[6] < reference[1]
    at3 = stopped_at(saved, 3, tmp_path / "at3")
    resumed = _losses(run_ranks(2, run_pretrain, _argv(6, 1, 2, *vpp, "--load", str(at3))))
    assert resumed == {i: reference[i] for i in range(4, 7)}


@pytest.mark.slow
@pytest.mark.megatron_training
def test_resume_with_dropout_continues_the_curve_bit_exactly(tmp_path):
    """Megatron-LM's default dropout (0.1, hidden and attention) draws from the default generator on a CPU,
    which the data loaders must not draw from: a run resumed at 3 gives iterations 4-6 bit for bit."""
    def argv(*extra: str) -> list[str]:
        base = _argv(6, 1, 1, *extra)
        for name in ("--hidden-dropout", "--attention-dropout"):
            base[base.index(name) + 1] = "0.1"
        return base

    saved = tmp_path / "saved"
    reference = _losses(run_ranks(1, run_pretrain, argv("--save", str(saved), "--save-interval", "3")))
    at3 = stopped_at(saved, 3, tmp_path / "at3")
    assert _losses(run_ranks(1, run_pretrain, argv("--load", str(at3)))) == {i: reference[i] for i in range(4, 7)}


# the npu kernel provider on the CPU, over tests/doubles' torch_npu (as tests/test_kernel_models.py runs it)
NPU_DOUBLE = {"ADAPTER_BACKEND": "cpu", "ADAPTER_KERNELS": "npu", "PYTHONPATH": str(DOUBLES)}


def _qwen3(tp: int, env: dict | None = None) -> list[dict]:
    """qwen3-tiny for 8 iterations at TP ``tp``, the whole weights initialized on the CPU and split
    (Megatron-LM's --use-cpu-initialization)."""
    return run_ranks(tp, run_pretrain, _argv(8, tp, 1, "--use-cpu-initialization", model="qwen3-tiny"), env=env)


@pytest.mark.slow
@pytest.mark.megatron_training
def test_qwen3_trains_and_the_npu_provider_at_tp2_gives_the_torch_providers_curve():
    """qwen3-tiny: 4 heads of 32 in a hidden size of 64 (megatron's kv_channels apart from hidden / heads),
    QK-norm, tied embeddings. At TP2 (two heads and one query group a rank, each head's queries and keys
    normed on their own rank: megatron's QK-norm is per head) the loss falls with the torch provider, and
    through the npu provider over the torch_npu double the same batches give the same curve up to
    reduction order: the provider's kernels hold on split heads."""
    torch_tp2 = _losses(_qwen3(2))
    assert sorted(torch_tp2) == list(range(1, 9)) and torch_tp2[8] < torch_tp2[1] - 0.3, torch_tp2
    runs = _qwen3(2, NPU_DOUBLE)
    assert "kernels from the npu provider" in runs[0]["stdout"], runs[0]["stdout"][-2000:]
    npu_tp2 = _losses(runs)
    for i in torch_tp2:
        assert npu_tp2[i] == pytest.approx(torch_tp2[i], abs=1e-5), (npu_tp2, torch_tp2)


@pytest.mark.slow
@pytest.mark.megatron_training
def test_qwen3_at_tp2_gives_the_tp1_curve():
    """The same batches, the same whole weights: TP2 (split heads, per-head QK-norm) gives TP1's curve up to
    reduction order. The whole weights are the same only if nothing draws from the host generator between
    the seed and the model by TP: megatron's JIT warm-up draws TP-shaped tensors on the device, on the cpu
    backend from the host's generator (patches/rng.py keeps its state; without it iteration 1 was 6.2453 at
    TP2 against 6.2582 at TP1)."""
    tp1, tp2 = _losses(_qwen3(1)), _losses(_qwen3(2))
    for i in tp1:
        assert tp2[i] == pytest.approx(tp1[i], abs=1e-5), (tp2, tp1)


def _validation_losses(stdout: str) -> dict[int, float]:
    found = re.findall(r"validation loss at iteration (\d+) \| lm loss value: ([0-9.E+-]+)", stdout)
    return {int(i): float(v) for i, v in found}


DEVICES = [pytest.param("cuda", marks=pytest.mark.cuda), pytest.param("npu", marks=pytest.mark.npu)]
MODELS = {"dense": ("--model", "qwen2.5-tiny"), "qwen3": ("--model", "qwen3-tiny"),
          "moe": ("--model", "gpt-tiny-moe", "--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall",
                  "--moe-permute-fusion", "--moe-aux-loss-coeff", "1e-2")}


@pytest.mark.megatron_training
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("device", DEVICES)
def test_the_flow_trains_and_resumes_on_the_device(device, model, tmp_path):
    """One rank on the device, bf16 with megatron's fusion flags at their defaults (the device's kernel
    provider answers them): 8 iterations stopped and saved at 4, then resumed; the loss falls from
    ln(vocab). The dense tiny Qwen, and the MoE flavor through the provider's grouped GEMM and permutation."""
    argv = [*_argv(8, 1, 1, "--bf16", "--save", str(tmp_path), "--save-interval", "1000", "--load",
                  str(tmp_path)), *MODELS[model]]
    env = {"ADAPTER_BACKEND": device, "ADAPTER_KERNELS": ""}
    first = _losses(run_ranks(1, run_pretrain, [*argv, "--exit-interval", "4"], env=env))
    resumed = _losses(run_ranks(1, run_pretrain, argv, env=env))
    assert sorted(first) == [1, 2, 3, 4] and sorted(resumed) == [5, 6, 7, 8]
    losses = [*first.values(), *resumed.values()]
    assert all(math.isfinite(loss) for loss in losses)
    assert losses[-1] < losses[0] - 0.3, losses


@pytest.mark.slow
@pytest.mark.megatron_training
def test_tiny_qwen_script_trains_saves_resumes_and_plots(tmp_path):
    """scripts/pretrain_qwen_tiny.sh from a fresh directory: the shipped corpus prepared, TP2 x PP2 on 4
    gloo ranks, stopped and saved at 15, resumed to 30 by a second run; the validation loss falls."""
    env = {**os.environ, "OUTPUT_DIR": str(tmp_path / "run"), "TRAIN_ITERS": "30", "EVAL_INTERVAL": "15",
           "PYTHON": sys.executable}
    first = subprocess.run(["bash", "scripts/pretrain_qwen_tiny.sh"], env={**env, "EXIT_INTERVAL": "15"},
                           cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert (tmp_path / "run" / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == "15"
    second = subprocess.run(["bash", "scripts/pretrain_qwen_tiny.sh"], env=env, cwd=ROOT, capture_output=True,
                            text=True, timeout=600)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert re.search(rf"successfully loaded checkpoint from {tmp_path / 'run' / 'checkpoints'} .*at iteration 15\b",
                     second.stdout), second.stdout[-3000:]
    losses = {**_validation_losses(first.stdout), **_validation_losses(second.stdout)}
    assert sorted(losses) == [15, 30]
    # from ln(512) = 6.24 at the start; the one flow measured 5.835 at 15 and 5.630 at 30 (2026-12-06; the
    # script warms the learning rate up over 20 iterations, so 30 is the fewest it trains)
    assert losses[30] < losses[15] - 0.1 and losses[15] < 6.0

    done = subprocess.run([sys.executable, "scripts/plot_loss.py", str(tmp_path / "run" / "tensorboard"),
                           "--output", str(tmp_path / "loss.png")], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.megatron_training
def test_tiny_moe_script_trains_and_logs_its_experts(tmp_path):
    """MODEL=qwen3-moe-tiny (QK-norm, heads of their own size): PP2 x EP2 on 4 gloo ranks from a fresh
    directory; the validation loss falls from ln(512) = 6.24, megatron.training's iteration lines carry the
    router loss and the adapter's line after each the expert load."""
    env = {**os.environ, "OUTPUT_DIR": str(tmp_path / "run"), "TRAIN_ITERS": "30", "EVAL_INTERVAL": "30",
           "MODEL": "qwen3-moe-tiny", "PYTHON": sys.executable}
    done = subprocess.run(["bash", "scripts/pretrain_qwen_tiny.sh"], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert list(_validation_losses(done.stdout)) == [30] and _validation_losses(done.stdout)[30] < 5.8
    line = next(line for line in done.stdout.splitlines() if "] iteration       25/" in line)  # megatron's
    assert "| load_balancing_loss: " in line
    assert "\n[adapter] iteration       25 | expert load max/mean: " in done.stdout  # after it, from the last rank
    assert (tmp_path / "run" / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == "30"


def test_plot_loss_without_logs_is_one_clear_error(tmp_path):
    done = subprocess.run([sys.executable, "scripts/plot_loss.py", str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "has no TensorBoard event files" in done.stderr
    assert "Traceback" not in done.stderr

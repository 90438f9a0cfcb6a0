"""megatron's warnings that the adapter has answered stay out of the output; every other warning shows,
and a user who sets warning filters, or ADAPTER_SHOW_ALL_WARNINGS=1, sees everything."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from packaging.version import Version

from adapter import backend as adapter_backend
from adapter import quiet_warnings
from adapter.quiet_warnings import SHOW_ALL_ENV
from adapter.registry import installed_megatron_core_version
from tests.distributed import ROOT, launch_script

IMPORTS = """
import warnings
import adapter
import megatron.core.optimizer, megatron.core.optimizer.clip_grads, megatron.core.models.backends
import megatron.core.models.gpt.gpt_layer_specs
warnings.warn("something real from the user's code")
warnings.warn_explicit("a real megatron warning", UserWarning, "megatron/core/x.py", 1, module="megatron.core.x")
warnings.warn_explicit("Apex is not installed. Falling back to Torch Norm", UserWarning, "mine.py", 1, module="mine")
"""
FALLBACKS = ("Transformer Engine and Apex are not installed. Falling back to Torch optimizers",
             "Falling back to local implementations of multi_tensor_applier",
             "megatron/core/models/backends.py:21: UserWarning: Apex is not installed. Falling back to Torch Norm")
REAL = ("something real from the user's code", "a real megatron warning",
        "mine.py:1: UserWarning: Apex is not installed. Falling back to Torch Norm")


def _stderr(*python_args: str, env: dict | None = None) -> str:
    done = subprocess.run([sys.executable, *python_args, "-c", IMPORTS], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_answered_fallbacks_are_silent_and_real_warnings_show():
    stderr = _stderr()
    assert [f for f in FALLBACKS if f in stderr] == []
    assert [r for r in REAL if r not in stderr] == []


@pytest.mark.parametrize("python_args, env", [(("-W", "default"), None), ((), {"ADAPTER_SHOW_ALL_WARNINGS": "1"})],
                         ids=["-W default", "ADAPTER_SHOW_ALL_WARNINGS=1"])
def test_the_user_can_see_every_warning(python_args, env):
    stderr = _stderr(*python_args, env=env)
    assert "Transformer Engine and Apex are not installed. Falling back to Torch optimizers" in stderr
    assert all(r in stderr for r in REAL)


def test_the_kernel_summary_names_the_backend_provider_each_op_and_the_optimizer():
    from adapter.report import FUNCTION_OPS, kernel_summary

    summary = kernel_summary()
    assert summary.startswith("[adapter] backend cpu (gloo); kernels from the torch provider: ")
    assert all(f"{op} " in summary for op in [*FUNCTION_OPS, "core_attention", "norm_module"])
    assert "rms_norm torch_provider." in summary and "optimizer torch.optim.adamw.AdamW" in summary
    assert "\n" not in summary


# What every rank of the README's tiny run (TP 2 with sequence parallelism, the distributed optimizer, a save)
# printed on megatron-core 0.19 that does not apply to it: torch's notices where there is a CUDA toolkit and no
# GPU or no accelerator at all, megatron's hint for CUDA's queues, its Transformer Engine version where there
# is none, and notices about code the run does not use.
NOT_APPLYING = ("MimoModelConfig is experimental and still under active development",
                "When using sequence parallelism it is recommended to set the environment variable "
                "CUDA_DEVICE_MAX_CONNECTIONS to 1",
                "MCore's async save is deprecated",
                "DistributedDataParallel: full_param_layout not provided",
                "RerunStateMachine initialized in mode", "Result validation enabled",
                "Only transformer-engine>=1.7.0 supports MoE experts, but your version is 0.0.0",
                "'pin_memory' argument is set as true but no accelerator is found",
                "No CUDA runtime is found, using CUDA_HOME=")
# said only where Transformer Engine is absent, or where there is no GPU; two never by megatron.training's
# pretrain (scripts/pretrain_gpt.py): off CUDA the adapter's validate_args wrap sets CUDA_DEVICE_MAX_CONNECTIONS
# to 1, and megatron.training gives its DDP the parameter layout (their rows stay for the own loop)
NOT_EVERYWHERE = {NOT_APPLYING[-3]: importlib.util.find_spec("transformer_engine") is None,
                  NOT_APPLYING[-2]: not torch.cuda.is_available(), NOT_APPLYING[-1]: not torch.cuda.is_available(),
                  NOT_APPLYING[1]: False, NOT_APPLYING[3]: False}
SINCE_0_19 = Version(installed_megatron_core_version()) >= Version("0.19")


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.skipif(not SINCE_0_19, reason="the messages are megatron-core 0.19's")
def test_the_tiny_run_says_nothing_that_does_not_apply_unless_asked_for_everything(tmp_path):
    """Two launches of scripts/pretrain_gpt.py on 2 ranks; CUDA_HOME makes torch's notice due wherever there
    is no GPU. With the filters no rank prints any of these; with ADAPTER_SHOW_ALL_WARNINGS=1 each shows, so the
    filters, not an absent cause, keep them out."""
    argv = ["--model", "qwen2.5-tiny", "--tensor-model-parallel-size", "2", "--sequence-parallel",
            "--use-distributed-optimizer", "--micro-batch-size", "2", "--global-batch-size", "2", "--seq-length",
            "32", "--train-iters", "1", "--lr", "1e-3", "--mock-data", "--eval-iters", "0", "--eval-interval", "1000",
            "--save-interval", "1", "--save"]
    env = {"ADAPTER_BACKEND": "cpu", "CUDA_HOME": str(tmp_path)}
    quiet = launch_script("scripts/pretrain_gpt.py", [*argv, tmp_path / "quiet"], env=env)
    assert [status for status, _ in quiet] == [0, 0], quiet[0][1][-3000:]
    assert [[m for m in NOT_APPLYING if m in output] for _, output in quiet] == [[], []]
    everything = launch_script("scripts/pretrain_gpt.py", [*argv, tmp_path / "all"], env={**env, SHOW_ALL_ENV: "1"})
    output = "".join(output for _, output in everything)
    due = [m for m in NOT_APPLYING if NOT_EVERYWHERE.get(m, True)]
    assert [m for m in due if m not in output] == [], output[-3000:]


@pytest.mark.parametrize("backend, rank, in_force", [("cpu", "0", True), ("npu", "0", True), ("cuda", "1", True),
                                                     ("cuda", "0", False)])
def test_the_cuda_queue_hint_is_said_by_cuda_rank_0_only(monkeypatch, backend, rank, in_force):
    monkeypatch.setattr(adapter_backend, "current", lambda: adapter_backend.Backend(backend))
    monkeypatch.setenv("RANK", rank)
    row = next(row for row in quiet_warnings.TABLE if "CUDA_DEVICE_MAX_CONNECTIONS" in row.message)
    assert quiet_warnings.WHERE[row.where]() is in_force

"""megatron's warnings that the adapter has answered stay out of the output; every other warning shows,
and a user who sets warning filters, or ADAPTER_SHOW_ALL_WARNINGS=1, sees everything."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.distributed import ROOT

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

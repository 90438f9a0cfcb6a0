"""The import stand-in for megatron-core's triton-only batch_invariant_kernels (adapter.stand_ins): what it
answers, that it refuses batch-invariant mode, and that uninstall() gives the real import back. In a fresh
interpreter, since uninstalling is process-wide."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.distributed import ROOT

PROGRAM = r"""
import json
import adapter
from adapter import stand_ins
from patches.megatron_lm import BATCH_INVARIANT_KERNELS as NAME

import megatron.core.transformer.custom_layers.batch_invariant_kernels as kernels

seen = {"rows": stand_ins.rows(), "enabled": kernels.is_batch_invariant_mode_enabled()}
kernels.disable_batch_invariant_mode()
with kernels.set_batch_invariant_mode(False):
    pass
for name, call in (("enable", kernels.enable_batch_invariant_mode), ("set", kernels.set_batch_invariant_mode)):
    try:
        call()
    except RuntimeError as exc:
        seen[name] = str(exc)
stand_ins.uninstall()
try:
    import megatron.core.transformer.custom_layers.batch_invariant_kernels
except ModuleNotFoundError as exc:
    seen["after_uninstall"] = str(exc)
seen["rows_after"] = stand_ins.rows()
print("RESULT " + json.dumps(seen))
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is not None, reason="triton is installed: no stand-in")
def test_stand_in_refuses_batch_invariant_mode_and_uninstall_restores_the_real_import():
    env = {**os.environ, "ADAPTER_BACKEND": "cpu", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", PROGRAM], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
    [row] = seen["rows"]
    assert (row["status"], row["why"]) == ("applied", "triton is not importable")
    assert seen["enabled"] is False
    refusal = "--batch-invariant-mode needs triton (its kernels are triton kernels), which is not installed"
    assert seen["enable"].startswith(refusal) and seen["set"].startswith(refusal)
    assert seen["after_uninstall"] == "No module named 'triton'"
    assert [(r["status"], r["why"]) for r in seen["rows_after"]] == [
        ("skipped", "uninstalled (adapter.stand_ins.uninstall())")]

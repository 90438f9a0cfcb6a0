"""The flow's entry point asks torch.compile's CPU vector-ISA question in the background, so the first
compiled call finds the answer instead of probing inside the first iteration."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.distributed import ROOT

PROGRAM = r"""
import json
import torch
from torch._inductor.cpu_vec_isa import valid_vec_isa_list
from adapter.training import compile_probe

thread = compile_probe.probe_in_background()
thread.join(timeout=120)
probed = valid_vec_isa_list.cache_info()
torch.compile(lambda x: x * 2 + 1)(torch.ones(8))  # the first C++ build of this process
compiled = valid_vec_isa_list.cache_info()
print(json.dumps({"probed": [probed.misses, probed.currsize], "misses after compile": compiled.misses,
                  "hits after compile": compiled.hits}))
"""


@pytest.mark.slow
def test_the_first_compile_uses_the_answer_probed_in_the_background():
    done = subprocess.run([sys.executable, "-c", PROGRAM], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "ADAPTER_BACKEND": "cpu", "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["probed"] == [1, 1]  # asked once, by the thread
    assert seen["misses after compile"] == 1 and seen["hits after compile"] >= 1  # the compile reused it


def test_no_probe_off_the_cpu_backend(monkeypatch):
    import adapter
    from adapter.backend import Backend
    from adapter.training import compile_probe

    monkeypatch.setattr(adapter, "current_backend", lambda: Backend("cuda"))
    assert compile_probe.probe_in_background() is None

"""The launch asks torch.compile's CPU vector-ISA question in the background, so the first compiled call (the
torch provider's RMSNorm, megatron's fused functions) finds the answer instead of probing inside the first
iteration: scripts/pretrain_gpt.py asks the adapter to start adapter/compile_probe.py's probe as soon as it
knows the backend, and waits for it before megatron.training starts."""

from __future__ import annotations

import pytest

from tests.distributed import run_program

PROGRAM = r"""
import json
import threading
import torch
from torch._inductor.cpu_vec_isa import valid_vec_isa_list
import scripts.pretrain_gpt  # the entry's imports, all a launch runs before its main

for thread in threading.enumerate():
    if thread is not threading.main_thread():
        thread.join(timeout=120)
probed = valid_vec_isa_list.cache_info()
torch.compile(lambda x: x * 2 + 1)(torch.ones(8))  # the first C++ build of this process
compiled = valid_vec_isa_list.cache_info()
print(json.dumps({"probed": [probed.misses, probed.currsize], "misses after compile": compiled.misses,
                  "hits after compile": compiled.hits}))
"""


@pytest.mark.slow
def test_the_first_compile_uses_the_answer_the_entry_probed_in_the_background():
    seen = run_program(PROGRAM)
    assert seen["probed"] == [1, 1]  # asked once, by the entry's thread
    assert seen["misses after compile"] == 1 and seen["hits after compile"] >= 1  # the compile reused it


def test_no_probe_off_the_cpu_backend(monkeypatch):
    import adapter
    from adapter import compile_probe
    from adapter.backend import Backend

    monkeypatch.setattr(adapter, "current_backend", lambda: Backend("cuda"))
    assert compile_probe.probe_in_background() is None


EARLY = r"""
import json
import os
import sys
import threading

import torch._inductor.cpu_vec_isa as isa

seen = {}
probe = isa.valid_vec_isa_list


def recorded():  # what was imported when the probe began
    seen["patch table imported"] = "patches" in sys.modules
    return probe()


isa.valid_vec_isa_list = recorded
import scripts.pretrain_gpt  # noqa: E402,F401 - the entry's imports, all a launch runs before its main

for thread in threading.enumerate():
    if thread is not threading.main_thread():
        thread.join(timeout=120)
seen["request left for children"] = os.environ.get("ADAPTER_COMPILE_PROBE")
print(json.dumps(seen))
"""


@pytest.mark.slow
def test_the_entry_starts_the_probe_before_the_adapter_imports_its_patches_and_its_children_do_not_probe_again():
    """The probe begins once the adapter knows the backend, before its patch table (2 s of imports: inductor's
    compiler, the kernel providers) and the entry's megatron.training; the request is not inherited."""
    seen = run_program(EARLY)
    assert seen == {"patch table imported": False, "request left for children": None}


WAITED = r"""
import json
import threading
import scripts.pretrain_gpt as entry

seen = {}


def recorded(train, *args):  # what megatron.training would start with: which threads are still running
    seen["threads"] = [thread.name for thread in threading.enumerate()]
    return 0


entry.adapter_run.run_guarded = recorded
entry.main()
print(json.dumps(seen))
"""


@pytest.mark.slow
def test_the_probe_has_finished_before_megatron_training_starts_and_forks():
    """A fork without exec (megatron's data loader workers) while the probe starts its subprocess would
    inherit the pipe that subprocess is read by, and the lock inductor holds: the probe, and every process
    compiling with that cache, would wait for good (adapter/compile_probe.py)."""
    threads = run_program(WAITED)["threads"]
    assert "inductor-vec-isa-probe" not in threads and "MainThread" in threads

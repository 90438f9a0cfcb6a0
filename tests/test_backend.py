"""Backend selection refuses what this machine cannot do, clearly; the device layer works on CPU."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time

import pytest
import torch

import adapter
from adapter import backend, device
from adapter.backend import Backend, BackendUnavailable, select_backend
from tests.distributed import ROOT

on_cpu = pytest.mark.skipif(adapter.current_backend().name != "cpu" or torch.cuda.is_available()
                            or importlib.util.find_spec("torch_npu") is not None,
                            reason="these checks describe a machine without an accelerator")


# ---------------------------------------------------------------- select_backend
@on_cpu
def test_npu_without_torch_npu():
    with pytest.raises(BackendUnavailable) as info:
        select_backend("npu")
    message = str(info.value)
    assert message.startswith("ADAPTER_BACKEND=npu was asked for, but torch_npu cannot be imported")
    assert "torch_npu" in message and "CANN" in message and "set_env.sh" in message
    assert "Or set ADAPTER_BACKEND=cpu." in message


@on_cpu
def test_cuda_on_a_cpu_only_build():
    if torch.backends.cuda.is_built():
        pytest.skip("this torch is a CUDA build")
    with pytest.raises(BackendUnavailable,
                       match=r"ADAPTER_BACKEND=cuda was asked for, but this torch \(.*\) is a CPU-only "
                             r"build\. Install a CUDA build of torch"):
        select_backend("cuda")


def test_unknown_backend_names_the_value_and_the_choices():
    with pytest.raises(BackendUnavailable,
                       match=r"ADAPTER_BACKEND='tpu' is not a backend\. Use one of cpu, cuda, npu"):
        select_backend("tpu")


@on_cpu
@pytest.mark.parametrize("requested", ["", "auto", " CPU ", "cpu"])
def test_automatic_and_explicit_cpu(requested):
    assert select_backend(requested) == Backend("cpu")


@on_cpu
def test_unset_env_means_automatic(monkeypatch):
    monkeypatch.delenv(backend.BACKEND_ENV, raising=False)
    assert select_backend() == Backend("cpu")
    monkeypatch.setenv(backend.BACKEND_ENV, "tpu")
    with pytest.raises(BackendUnavailable, match="'tpu'"):
        select_backend()


def test_backend_properties():
    assert [Backend(n).dist_backend for n in ("cpu", "cuda", "npu")] == ["gloo", "nccl", "hccl"]
    assert not Backend("cpu").is_accelerator and Backend("npu").is_accelerator
    assert Backend("cpu").torch_module is torch.cpu


@on_cpu
def test_import_adapter_with_an_unusable_backend_fails_with_one_clear_line():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["ADAPTER_BACKEND"] = "npu"
    proc = subprocess.run([sys.executable, "-c", "import adapter"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("adapter.backend.BackendUnavailable: ADAPTER_BACKEND=npu was asked for, "
                                "but torch_npu cannot be imported"), proc.stderr
    assert "CANN" in lines[-1] and "Or set ADAPTER_BACKEND=cpu." in lines[-1]
    frames = [line for line in lines if line.lstrip().startswith('File "/')]
    assert frames and all("/adapter/" in f for f in frames), proc.stderr  # no megatron frame involved
    assert "During handling of the above exception" not in proc.stderr  # one error, not a chain
    assert sum(line.startswith("adapter.backend.BackendUnavailable") for line in lines) == 1


# ---------------------------------------------------------------- the device layer on CPU
@on_cpu
def test_current_device_is_cpu():
    assert device.current_device() == torch.device("cpu")
    assert device.torch_device() == torch.device("cpu")
    assert device.is_available() is True  # the backend's device, the CPU, is there
    assert device.has_accelerator() is False
    assert device.device_count() == 1
    torch.zeros(2, device=device.current_device())  # megatron passes it as device=


@on_cpu
def test_rng_state_round_trips_the_cpu_generator():
    saved = torch.get_rng_state()
    try:
        device.manual_seed(1234)
        state = device.get_rng_state()
        assert torch.equal(state, torch.get_rng_state())
        first = torch.rand(5)
        device.set_rng_state(state)
        assert torch.equal(torch.rand(5), first)
        assert device.initial_seed() == 1234
        assert device.random.get_rng_state is device.get_rng_state
    finally:
        torch.set_rng_state(saved)


@on_cpu
def test_event_timing():
    start, end = device.Event(enable_timing=True), device.Event(enable_timing=True)
    start.record()
    time.sleep(0.01)
    end.record()
    elapsed = start.elapsed_time(end)
    assert isinstance(elapsed, float)
    assert elapsed >= 0
    assert elapsed >= 5  # milliseconds, as on CUDA
    device.synchronize()
    end.synchronize()  # torch.cpu.Event API still there


@on_cpu
def test_synchronize_is_a_no_op():
    assert device.synchronize() is None
    assert device.synchronize(0) is None


@on_cpu
def test_memory_counters_are_zero():
    torch.ones(1024)  # allocate something: still 0, the CPU allocator keeps no statistics
    for counter in (device.memory_allocated, device.max_memory_allocated, device.memory_reserved,
                    device.max_memory_reserved):
        assert counter() == 0
        assert counter(0) == 0
    assert device.memory_stats() == {}
    assert device.reset_peak_memory_stats() is None
    assert device.empty_cache() is None
    # the torch.cuda.memory.<name> spelling reaches the same functions
    assert device.memory.empty_cache is device.empty_cache
    assert device.memory.max_memory_allocated is device.max_memory_allocated

"""Optimizer offloading to host memory on the cpu backend: refused with the fix, because as written it
silently loses the offloaded parameters' updates; without offloading, megatron's HybridDeviceOptimizer
runs and matches torch's own Adam (the reference).

Under the host stand-in (``adapter.host_memory``: host copies told apart from device tensors as on an NPU)
megatron's offloading path runs as an NPU runs it: the optimizer alone matches torch's Adam with its state
split between device and host as the fraction says, and the tiny GPT in DDP with the distributed optimizer
trains the curve of the same run without offloading, at DP2 and TP2 x DP2, on torch's kernels and on the
npu provider's (the torch_npu double)."""

import pytest
import torch

import adapter  # noqa: F401 - routing and the patch table before megatron
from adapter import backend, host_memory
from patches.host_offload import HostOffloadError
from scripts.train_tiny_gpt import Run
from tests.conftest import DOUBLES
from tests.distributed import run_ranks
from tests.offload_ranks import train

pytestmark = pytest.mark.skipif(backend.current().name != "cpu", reason="the refusal is for the cpu backend")


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _train(model, optimizer, steps=3):
    torch.manual_seed(1)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(5, 4)).square().sum().backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def _hybrid(model, offload_fraction, init=None, **kwargs):
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    optimizer = HybridDeviceOptimizer.__new__(HybridDeviceOptimizer)
    (init or HybridDeviceOptimizer.__init__)(optimizer, list(model.parameters()), offload_fraction=offload_fraction,
                                             cpu_optimizer_cls=torch.optim.Adam, gpu_optimizer_cls=torch.optim.Adam,
                                             lr=0.1, **kwargs)
    return optimizer


def _reference():
    model = _model()
    return _train(model, torch.optim.Adam(model.parameters(), lr=0.1))


def _state_bytes(optimizer, host: bool) -> int:
    return sum(t.numel() * t.element_size() for state in optimizer.state.values() for t in state.values()
               if torch.is_tensor(t) and t.dim() > 0 and host_memory.is_host(t) == host)


def test_without_offloading_the_hybrid_optimizer_matches_torch_adam():
    model = _model()
    for got, want in zip(_train(model, _hybrid(model, 0)), _reference()):
        torch.testing.assert_close(got, want)


def test_offloading_is_refused_where_the_optimizer_is_built():
    with pytest.raises(HostOffloadError, match=r"offload_fraction=0\.5.*--optimizer-cpu-offload"):
        _hybrid(_model(), 0.5)


def test_offloading_is_refused_where_it_is_configured():
    from megatron.core.optimizer import OptimizerConfig

    with pytest.raises(HostOffloadError, match=r"optimizer_offload_fraction=1\.0.*--optimizer-cpu-offload"):
        OptimizerConfig(optimizer_cpu_offload=True, optimizer_offload_fraction=1.0)
    assert OptimizerConfig(optimizer_cpu_offload=True, optimizer_offload_fraction=0.0).optimizer_cpu_offload


def test_what_the_refusal_prevents_offloaded_updates_are_lost():
    """megatron's own constructor, unrefused: the host copies' updates never reach the model."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    model = _model()
    got = _train(model, _hybrid(model, 1.0, init=HybridDeviceOptimizer.__init__.__wrapped__))
    assert not all(torch.allclose(g, w) for g, w in zip(got, _reference()))


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_under_the_host_stand_in_offloading_matches_torch_adam_with_its_state_on_the_host(fraction, monkeypatch):
    """megatron's constructor and step as an NPU runs them (as megatron builds it: fp32 updates, overlapped
    copies on side streams): the updates reach the model, and the state of the offloaded fraction is host's."""
    monkeypatch.setenv(host_memory.STAND_IN_ENV, "1")
    model = _model()
    optimizer = _hybrid(model, fraction, param_update_in_fp32=True, overlap_cpu_optimizer_d2h_h2d=True)
    for got, want in zip(_train(model, optimizer), _reference()):
        torch.testing.assert_close(got, want)
    on_host, on_device = _state_bytes(optimizer, True), _state_bytes(optimizer, False)
    total = sum(p.numel() for p in model.parameters()) * 4 * 3  # fp32: two moments and the main parameter
    assert on_host + on_device == total
    assert (on_device == 0) if fraction == 1.0 else (0 < on_device < total and on_host >= total * fraction)


def test_offloading_float32_parameters_is_refused_in_one_line_and_bf16_passes(monkeypatch):
    """megatron hands the offloading optimizer float32 parameters as views, which torch's optimizers refuse
    with a traceback on every rank (tests/offload_ranks.py trains bf16)."""
    from megatron.core.optimizer import OptimizerConfig

    monkeypatch.setenv(host_memory.STAND_IN_ENV, "1")
    offload = dict(optimizer_cpu_offload=True, use_precision_aware_optimizer=True, use_distributed_optimizer=True,
                   optimizer_offload_fraction=0.5)
    with pytest.raises(HostOffloadError, match=r"^optimizer_cpu_offload=True with float32 parameters .*--bf16"):
        OptimizerConfig(**offload)
    assert OptimizerConfig(bf16=True, **offload).optimizer_cpu_offload


def test_the_host_stand_in_is_off_for_a_real_cpu_run():
    assert not host_memory.stand_in()
    with pytest.raises(HostOffloadError):
        _hybrid(_model(), 1.0)


def _offload_shares(reference: dict, offloaded: dict, fraction: float) -> None:
    total = reference["device_state_bytes"]
    assert (reference["host_state_bytes"], offloaded["device_state_bytes"] + offloaded["host_state_bytes"]) == (
        0, total)
    host_share = offloaded["host_state_bytes"] / total
    assert host_share == 1.0 if fraction == 1.0 else fraction <= host_share < fraction + 0.1


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("tp, kernels", [(1, "torch"), (2, "torch"), (1, "npu")])
def test_offloaded_optimizer_trains_the_distributed_optimizer_curve_with_its_state_on_the_host(tp, kernels):
    """The tiny GPT (bf16) at DP2 (and TP2 x DP2), 10 iterations: megatron's HybridDeviceOptimizer at offload
    fractions 0.5 and 1.0 against the distributed optimizer without offloading (the reference)."""
    env = {host_memory.STAND_IN_ENV: "1"}
    if kernels == "npu":
        env.update(ADAPTER_KERNELS="npu", PYTHONPATH=str(DOUBLES))
    run = Run(tp=tp, steps=10)
    reference = run_ranks(2 * tp, train, run, None, env=env)
    for fraction in (0.5, 1.0):
        for ref, offloaded in zip(reference, run_ranks(2 * tp, train, run, fraction, env=env)):
            assert offloaded["hybrid"] and not ref["hybrid"]
            assert len(offloaded["losses"]) == 10
            assert max(abs(a - b) for a, b in zip(ref["losses"], offloaded["losses"])) <= 1e-5
            _offload_shares(ref, offloaded, fraction)

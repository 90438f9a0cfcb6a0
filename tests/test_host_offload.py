"""Optimizer offloading to host memory on the cpu backend: refused with the fix, because as written it
silently loses the offloaded parameters' updates; without offloading, megatron's HybridDeviceOptimizer
runs and matches torch's own Adam (the reference)."""

import pytest
import torch

import adapter  # noqa: F401 - routing and the patch table before megatron
from adapter import backend
from patches.host_offload import HostOffloadError

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


def _hybrid(model, offload_fraction, init=None):
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    optimizer = HybridDeviceOptimizer.__new__(HybridDeviceOptimizer)
    (init or HybridDeviceOptimizer.__init__)(optimizer, list(model.parameters()), offload_fraction=offload_fraction,
                                             cpu_optimizer_cls=torch.optim.Adam, gpu_optimizer_cls=torch.optim.Adam,
                                             lr=0.1)
    return optimizer


def _reference():
    model = _model()
    return _train(model, torch.optim.Adam(model.parameters(), lr=0.1))


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

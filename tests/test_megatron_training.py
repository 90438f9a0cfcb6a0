"""Patches to megatron.training that need no Megatron-LM checkout: megatron-core 0.17+ ships
megatron.training in its wheel, so what a user of the wheel meets is tested against the wheel."""

from __future__ import annotations

import pytest
import torch

import adapter


def test_activation_logging_hooks_the_layers_a_model_holds_without_transformer_engine():
    """megatron.training's activation logging (new in 0.18: in the wheel, or in a checkout) over a model, where
    Transformer Engine is absent and ``LINEAR_TYPES`` lists TE's placeholders: megatron's own
    ``_register_hooks`` raises TypeError there; through the adapter the Linear is hooked."""
    activation_logging = pytest.importorskip("megatron.training.activation_logging",
                                             reason="megatron.training has no activation logging before 0.18")
    if all(isinstance(t, type) for t in activation_logging.LINEAR_TYPES):
        pytest.skip("Transformer Engine is installed: LINEAR_TYPES holds its classes")
    assert adapter.registry.status("megatron.training.activation_logging:_register_hooks") == "applied"
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    seen = []
    hooks = activation_logging._register_hooks([model], activation_logging.LINEAR_TYPES,
                                               lambda chunk, name: lambda *args: seen.append((chunk, name)))
    model(torch.ones(1, 2))
    assert seen == [("model_chunk0", "0")] and len(hooks) == 1

"""megatron.training's own ``pretrain`` on the GPT step of ``flow.gpt``: what Megatron-LM's
``pretrain_gpt.py`` main block does, for the release installed (``flow.releases``), with the hybrid models
built by the project's builder (``flow.hybrid``). ``scripts/pretrain_gpt.py`` calls ``run``."""

from __future__ import annotations

import functools
import sys

from flow import gpt, hybrid, model_flags, releases


def run(argv: list[str]) -> None:
    """Train as Megatron-LM's ``pretrain_gpt.py`` would on ``argv``, ``--model NAME`` expanded first."""
    sys.argv[1:] = model_flags.expand(argv)
    name = model_flags.name(argv)
    model_inputs = functools.partial(hybrid.pretrain_inputs, name=name) if hybrid.named(name) else None
    releases.pretrain_gpt(gpt.train_valid_test_datasets_provider, gpt.forward_step, model_inputs)

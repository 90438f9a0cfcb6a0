"""megatron.training's own ``pretrain`` on the GPT step of ``flow.gpt``: what Megatron-LM's
``pretrain_gpt.py`` main block does, for the release installed. ``scripts/pretrain_gpt.py`` calls ``run``."""

from __future__ import annotations

import sys

from megatron.core.enums import ModelType
from megatron.training import pretrain
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
from megatron.training.arguments import parse_and_validate_args

from flow import gpt, hybrid, model_flags

# Megatron-LM's pretrain_gpt.py gives the same default
ARGS_DEFAULTS = {"tokenizer_type": "GPT2BPETokenizer"}


def run(argv: list[str]) -> None:
    """Train as Megatron-LM's ``pretrain_gpt.py`` would on ``argv``, ``--model NAME`` expanded first."""
    sys.argv[1:] = model_flags.expand(argv)
    args = parse_and_validate_args(args_defaults=ARGS_DEFAULTS)
    name = model_flags.name(argv)
    if hybrid.named(name):  # a hybrid model: the project's builder (flow.hybrid); the rest megatron's own
        container, model_provider = hybrid.pretrain_inputs(args, name)
    else:
        container, model_provider = pretrain_cfg_container_from_args(args, gpt_config_from_args(args)), None
    pretrain(container, gpt.train_valid_test_datasets_provider, ModelType.encoder_or_decoder, gpt.forward_step,
             model_provider=model_provider)

"""``--model NAME`` as Megatron-LM's own flags, expanded in argv before megatron.training parses it.

Expanded in argv rather than added to megatron's parser (``extra_args_provider``): the expanded command is
exactly what Megatron-LM's ``pretrain_gpt.py`` takes, so both entry points parse the same words with the same
parser (issue 50 point 7); every release's ``pretrain`` parses ``sys.argv`` itself (0.17) or lets the script
do it (0.18+), and argv is the one input both read. The model's flags go first, so every flag the user gives,
before or after ``--model``, overrides them (argparse keeps the last value); ``--num-experts 0`` makes the
named model dense, its expert flags left out.
"""

from __future__ import annotations

import dataclasses

import models
from adapter.input_refusals import InputRefused
from models.config import HYBRID_FIELDS, ModelConfig, ModelConfigError
from models.hybrid import layer_pattern
from models.megatron_lm_args import described, flags


def name(argv: list[str]) -> str | None:
    """The NAME of ``--model NAME`` (or ``--model=NAME``) in ``argv``; None without one."""
    return _split(argv)[0]


def flow_flags(config: ModelConfig) -> list[str]:
    """The flags ``scripts/pretrain_gpt.py`` trains ``config`` on: Megatron-LM's, or one line for what they
    cannot say; a hybrid model's with megatron's layer pattern and Gated DeltaNet sizes (``flow.hybrid``
    builds it: Megatron-LM's own pretrain_gpt.py cannot, which is why ``flags`` refuses it). The pattern gives
    megatron its layer count, two per model layer, in place of ``--num-layers``."""
    if config.layer_types is None:
        return flags(config)
    words = described(config)
    at = words.index("--num-layers")
    del words[at:at + 2]
    sizes = [word for field in HYBRID_FIELDS for word in (f"--{field.replace('_', '-')}", str(getattr(config, field)))]
    return [*words, "--hybrid-layer-pattern", layer_pattern(config), *sizes]


def expand(argv: list[str], describe=flow_flags) -> list[str]:
    """``argv`` with ``--model NAME`` (or ``--model=NAME``) replaced by NAME's Megatron-LM flags (``describe``'s),
    put first."""
    named, rest = _split(argv)
    if named is None:
        return rest
    try:
        config = models.get(named)
        return [*describe(_dense(config) if _dense_asked(rest) else config), *rest]
    except ModelConfigError as exc:  # an unknown name, a model Megatron-LM's flags cannot describe
        raise InputRefused(f"--model {named}: {exc}") from None


def _dense_asked(words: list[str]) -> bool:
    """Whether the user's flags say ``--num-experts 0`` (Megatron-LM's dense model) over a named one."""
    return any(word == "--num-experts=0" or (word == "--num-experts" and following == "0")
               for word, following in zip(words, [*words[1:], None]))


def _dense(config: ModelConfig) -> ModelConfig:
    """``config`` without its mixture of experts: every expert setting at ModelConfig's default, so the named
    model's expert flags do not outlive its experts (megatron's TransformerConfig refuses an expert FFN size
    without experts)."""
    moe = {field.name: field.default for field in dataclasses.fields(ModelConfig)
           if field.name == "num_experts" or field.name.startswith("moe_")}
    return config.replace(**moe)


def _split(argv: list[str]) -> tuple[str | None, list[str]]:
    """(NAME of ``--model NAME``, the other words)."""
    words, name, rest = list(argv), None, []
    while words:
        word = words.pop(0)
        if word == "--model" and words:
            name = words.pop(0)
        elif word.startswith("--model="):
            name = word.split("=", 1)[1]
        else:
            rest.append(word)
    return name, rest

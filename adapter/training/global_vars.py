"""The process's parsed arguments and tokenizer, as Megatron-LM's ``get_args()`` / ``get_tokenizer()``
give them to model providers, dataset providers and forward steps."""

from __future__ import annotations

import argparse

_ARGS: argparse.Namespace | None = None
_TOKENIZER = None


def set_args(args: argparse.Namespace) -> None:
    global _ARGS
    _ARGS = args


def get_args() -> argparse.Namespace:
    if _ARGS is None:
        raise RuntimeError("no arguments yet: pretrain() (or set_args) sets them before the providers run")
    return _ARGS


def set_tokenizer(tokenizer) -> None:
    global _TOKENIZER
    _TOKENIZER = tokenizer


def get_tokenizer():
    if _TOKENIZER is None:
        raise RuntimeError("no tokenizer yet: pretrain() builds it from --tokenizer-type/--tokenizer-model")
    return _TOKENIZER

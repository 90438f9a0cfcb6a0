"""megatron.training builds its argument parser three times before the first iteration (parse_args,
ft_integration.setup, the adapter's flag defaults); patches/parser_docstrings.py reads each config
dataclass's field docstrings, megatron's help texts, once."""

from __future__ import annotations

import argparse

import pytest

pytestmark = pytest.mark.megatron_training  # megatron.training from the wheel (0.17+) or a checkout


def _helps(add_megatron_arguments) -> dict[str, str]:
    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    return {action.dest: action.help for action in parser._actions}


def test_the_parser_reads_each_config_s_source_once_and_gives_megatron_s_help(monkeypatch):
    import adapter  # noqa: F401 - the patch table
    from megatron.training import argument_utils
    from megatron.training.arguments import add_megatron_arguments

    factory = argument_utils.ArgumentGroupFactory
    _helps(add_megatron_arguments)  # the first build reads
    read = []
    source = argument_utils.inspect.getsource
    monkeypatch.setattr(argument_utils.inspect, "getsource", lambda obj: (read.append(obj), source(obj))[1])
    patched = _helps(add_megatron_arguments)
    assert read == []

    monkeypatch.setattr(factory, "_get_field_docstrings", factory._get_field_docstrings.__wrapped__)
    own = _helps(add_megatron_arguments)  # megatron's own reading, every class again
    assert read and patched == own
    assert sum(bool(text) for text in own.values()) > 100  # the help texts are there, not all empty

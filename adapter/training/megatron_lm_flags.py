"""Megatron-LM's flags that this flow lacks, refused in one line that says where they run.

A user brings a Megatron-LM launch script. A flag Megatron-LM has and ``scripts/pretrain_gpt.py`` does not
is no typo: it runs through Megatron-LM's own ``pretrain_gpt.py`` under ``python -m adapter.run``, and the
line says so instead of argparse's usage dump. A flag that turns on a feature needing a CUDA library
(``adapter.cuda_only_features.FEATURES``) gets that feature's refusal off CUDA, the line Megatron-LM's flow
gives too. Which flags are Megatron-LM's is read from Megatron-LM's own parser (``megatron.training``,
shipped in megatron-core 0.17+ wheels and in a Megatron-LM checkout), never a hand list; where it is not
importable, argparse's usual error stands.
"""

from __future__ import annotations

import argparse
import functools
import warnings

from adapter import backend, cuda_only_features

RUN_THROUGH_ADAPTER = ("run Megatron-LM's pretrain_gpt.py through the adapter: torchrun ... -m adapter.run "
                       "/path/to/Megatron-LM/pretrain_gpt.py <the same flags> (python -m adapter.run on one process)")


@functools.cache
def megatron_lm_parser() -> argparse.ArgumentParser | None:
    """Megatron-LM's argument parser, as its ``parse_args`` builds it (without parsing sys.argv); None where
    ``megatron.training`` cannot be imported. Its import-time warnings (Transformer Engine's MoE support and
    the like) are about a run that will not happen here: they are not said under the refusal's one line."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.training.arguments import add_megatron_arguments
    except Exception:  # noqa: BLE001 - any import failure means: no Megatron-LM parser to read here
        return None
    return add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False, exit_on_error=False))


def flag_of(token: str) -> str | None:
    """``--name`` of a command-line token (``--name=value`` too); None for a value."""
    if not token.startswith("--"):
        return None
    return token.split("=", 1)[0]


def _is_option(token: str) -> bool:
    """Whether a token is an option (``-1`` or ``-1e-3`` is a value)."""
    try:
        float(token)
    except ValueError:
        return token.startswith("-")
    return False


def refusal_for(unknown: list[str]) -> str | None:
    """The one line refusing ``unknown`` (the tokens the flow's parser did not take), or None where one of
    them is not Megatron-LM's either (argparse's own error then names it)."""
    parser = megatron_lm_parser()
    flags = [flag for flag in map(flag_of, unknown) if flag is not None]
    if parser is None or not flags or len(flags) != sum(map(_is_option, unknown)):
        return None
    if any(flag not in parser._option_string_actions for flag in flags):
        return None
    values = _megatron_lm_values(parser, unknown)
    for flag in flags:
        cuda_only = _cuda_library_refusal(flag, getattr(values, parser._option_string_actions[flag].dest, True))
        if cuda_only is not None:
            return cuda_only
    return (f"{' '.join(flags)}: Megatron-LM's flag{'s' if len(flags) > 1 else ''}, which this flow "
            f"(scripts/pretrain_gpt.py) does not have: {RUN_THROUGH_ADAPTER}")


def value_refusal(flag: str, value, choices) -> str | None:
    """The one line refusing ``flag value``, a value of one of the flow's flags that only Megatron-LM's
    takes (``choices``: the flow's); None where Megatron-LM's parser refuses it too."""
    parser = megatron_lm_parser()
    action = parser._option_string_actions.get(flag) if parser is not None else None
    if action is None or (action.choices is not None and value not in action.choices):
        return None
    cuda_only = _cuda_library_refusal(flag, value)
    if cuda_only is not None:
        return cuda_only
    return (f"{flag} {value}: Megatron-LM's value, which this flow (scripts/pretrain_gpt.py) does not have "
            f"(it takes {', '.join(map(str, choices))}): {RUN_THROUGH_ADAPTER}")


def _cuda_library_refusal(flag: str, value) -> str | None:
    """``refusal()``'s text where ``flag value`` turns on a CUDA-only feature, off CUDA: the line Megatron-LM's
    flow gives too."""
    if backend.current().name == "cuda":
        return None
    dest = megatron_lm_parser()._option_string_actions[flag].dest
    source = argparse.Namespace(**{dest: value})
    for feature in cuda_only_features.FEATURES:
        if dest in feature.settings and cuda_only_features.configured(feature, source) is not None:
            return str(cuda_only_features.refusal(feature, flag if value is True else f"{flag} {value}"))
    return None


def _megatron_lm_values(parser: argparse.ArgumentParser, unknown: list[str]) -> argparse.Namespace:
    """The values of ``unknown`` as Megatron-LM's parser types them; an empty namespace where it refuses them
    (each flag is then taken as switched on)."""
    try:
        values, _ = parser.parse_known_args(unknown, argparse.Namespace())
    except argparse.ArgumentError:
        return argparse.Namespace()
    return values

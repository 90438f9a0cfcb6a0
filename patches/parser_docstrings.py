"""megatron.training's argument parser is built three times before the first iteration: by ``parse_args``, by
``ft_integration.setup`` (a second ``parse_args``, to read one flag) and by ``adapter.input_refusals`` (each
flag's default). Each build reads and parses the source of every config dataclass for its fields'
docstrings, megatron's help texts (``ArgumentGroupFactory._get_field_docstrings``): 0.07 s a build of the 0.1 s.
A class's source does not change while the process runs, so its docstrings are read once."""

from __future__ import annotations

import functools


def read_once(get_field_docstrings):
    """``_get_field_docstrings``, answered from the first reading of each class; a copy each time, as megatron
    builds a new dict each time and its caller keeps it."""
    read: dict[type, dict[str, str]] = {}

    @functools.wraps(get_field_docstrings)
    def docstrings(self, src_cfg_class: type) -> dict[str, str]:
        if src_cfg_class not in read:
            read[src_cfg_class] = get_field_docstrings(self, src_cfg_class)
        return dict(read[src_cfg_class])

    return docstrings


def register(registry, versions: str) -> None:
    registry.wrap("megatron.training.argument_utils:ArgumentGroupFactory._get_field_docstrings", read_once,
                  versions=versions, optional=True,
                  reason="each config dataclass's source is parsed for its help texts once, not at each of the "
                         "three parser builds before the first iteration (0.14 s of start-up)")

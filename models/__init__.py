"""Named model configs (``models.get("qwen2.5-72b")``) and the megatron-core models built from them.

Families map flavor names to plain-data ``ModelConfig``s, torchtitan style; a model's full name is
``<family>-<flavor>``. Importing this package does not import megatron.
"""

from __future__ import annotations

from models import gpt, qwen
from models.config import ModelConfig, ModelConfigError

FAMILIES = {"gpt": gpt.FLAVORS, "qwen2.5": qwen.FLAVORS}


def names() -> list[str]:
    return [f"{family}-{flavor}" for family, flavors in FAMILIES.items() for flavor in flavors]


def get(name: str, **overrides) -> ModelConfig:
    """The named config, with ``overrides`` (ModelConfig field names) applied."""
    family, _, flavor = name.strip().lower().rpartition("-")
    flavors = FAMILIES.get(family, {})
    if flavor not in flavors:
        # names may contain '-' in the flavor too (gpt-tiny-tied)
        family, _, flavor = name.strip().lower().partition("-")
        flavors = FAMILIES.get(family, {})
    if flavor not in flavors:
        raise ModelConfigError(f"unknown model {name!r}: known models are {', '.join(names())}")
    config = flavors[flavor]
    return config.replace(**overrides) if overrides else config


__all__ = ["FAMILIES", "ModelConfig", "ModelConfigError", "get", "names"]

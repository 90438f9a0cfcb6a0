"""Named model configs (``models.get("qwen2.5-72b")``) and the megatron-core models built from them.

Families map flavor names to plain-data ``ModelConfig``s, torchtitan style; a model's full name is
``<family>-<flavor>``. Importing this package does not import megatron.
"""

from __future__ import annotations

from . import deepseek, gpt, qwen, qwen3, qwen35
from .config import ModelConfig, ModelConfigError

FAMILIES = {"gpt": gpt.FLAVORS, "qwen2.5": qwen.FLAVORS, "qwen3": qwen3.FLAVORS, "qwen3.5": qwen35.FLAVORS,
            "qwen3-next": qwen35.NEXT_FLAVORS, "deepseek": deepseek.DEEPSEEK_FLAVORS, "kimi": deepseek.KIMI_FLAVORS}


def names() -> list[str]:
    return [f"{family}-{flavor}" for family, flavors in FAMILIES.items() for flavor in flavors]


def get(name: str, **overrides) -> ModelConfig:
    """The named config, with ``overrides`` (ModelConfig field names) applied."""
    lowered = name.strip().lower()
    for family, flavors in FAMILIES.items():
        flavor = lowered.removeprefix(f"{family}-")
        if flavor != lowered and flavor in flavors:
            return flavors[flavor].replace(**overrides) if overrides else flavors[flavor]
    raise ModelConfigError(f"unknown model {name!r}: known models are {', '.join(names())}")


__all__ = ["FAMILIES", "ModelConfig", "ModelConfigError", "get", "names"]

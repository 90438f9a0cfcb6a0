"""Declarative weight mappings between Hugging Face tensors and megatron's checkpoint tensors (Megatron-Bridge
style), and the ``Architecture`` that lists them for one HF architecture.

A mapping names its megatron tensor (relative to ``decoder.layers.<i>.`` for a layer's) and its HF tensors
(``{layer}`` and, for an expert's, ``{expert}`` in the names), and converts whole tensors both ways:
``to_megatron(hf tensors, model)`` and ``to_hf(megatron tensors, model)``. ``row_range`` says which rows of
the megatron tensor HF tensor ``index`` is (start and count, or None when its rows are scattered), so both
directions can stream big tensors in row blocks. ``megatron_keys`` names every checkpoint tensor the HF
tensors are made of: one, or a module's sections (``Section``).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from .config import ModelConfig

LAYER_PREFIX = "decoder.layers."


class UnsupportedCheckpoint(ValueError):
    """A Hugging Face checkpoint this converter cannot represent faithfully: names what and why."""


class _OneTensor:
    """A mapping whose megatron side is the one checkpoint tensor ``megatron``."""

    def megatron_keys(self, key: str) -> list[str]:
        return [key]


@dataclasses.dataclass(frozen=True)
class Rename(_OneTensor):
    """One HF tensor is one megatron tensor."""
    megatron: str
    hf: str

    def hf_names(self, layer: str, expert: str = "") -> list[str]:
        return [self.hf.format(layer=layer, expert=expert)]

    def hf_shapes(self, model: ModelConfig, megatron_shape: tuple) -> list[tuple]:
        return [megatron_shape]

    def to_megatron(self, tensors: list[torch.Tensor], model: ModelConfig) -> torch.Tensor:
        return tensors[0]

    def to_hf(self, tensors: list[torch.Tensor], model: ModelConfig) -> list[torch.Tensor]:
        return tensors

    def row_range(self, index: int, megatron_rows: int) -> tuple[int, int] | None:
        return 0, megatron_rows


@dataclasses.dataclass(frozen=True)
class Copies(_OneTensor):
    """One megatron tensor HF stores under several names: DeepSeek-V3's MTP layer keeps its own copy of the
    embedding and of the output head, which megatron's MTP shares with the model. Written to every name, read
    from the first; the converter checks the others equal it (a copy that differs has no place in megatron)."""
    megatron: str
    hf: tuple[str, ...]

    def hf_names(self, layer: str, expert: str = "") -> list[str]:
        return [name.format(layer=layer, expert=expert) for name in self.hf]

    def hf_shapes(self, model: ModelConfig, megatron_shape: tuple) -> list[tuple]:
        return [megatron_shape] * len(self.hf)

    def to_megatron(self, tensors: list[torch.Tensor], model: ModelConfig) -> torch.Tensor:
        return tensors[0]

    def to_hf(self, tensors: list[torch.Tensor], model: ModelConfig) -> list[torch.Tensor]:
        return tensors * len(self.hf)

    def row_range(self, index: int, megatron_rows: int) -> tuple[int, int]:
        return 0, megatron_rows


@dataclasses.dataclass(frozen=True)
class ZeroCentred(Rename):
    """A norm weight HF stores as gamma and megatron as gamma - 1 (``layernorm_zero_centered_gamma``): Gated
    DeltaNet's output norm, whose HF module scales by its weight while every other norm of the model scales
    by 1 + weight. Computed in float32: exact both ways for gamma in [0.5, 2] (Sterbenz), as trained norm
    weights are."""

    def to_megatron(self, tensors: list[torch.Tensor], model: ModelConfig) -> torch.Tensor:
        return (tensors[0].float() - 1).to(tensors[0].dtype)

    def to_hf(self, tensors: list[torch.Tensor], model: ModelConfig) -> list[torch.Tensor]:
        return [(tensors[0].float() + 1).to(tensors[0].dtype)]

    def row_range(self, index: int, megatron_rows: int) -> None:
        return None  # not a copy


@dataclasses.dataclass(frozen=True)
class QKV(_OneTensor):
    """HF's separate q/k/v projections <-> megatron's fused ``linear_qkv``, whose rows run per query group:
    that group's query heads, then its key head, then its value head (so a TP split by rows keeps whole
    groups together)."""
    megatron: str
    q: str
    k: str
    v: str

    def hf_names(self, layer: str, expert: str = "") -> list[str]:
        return [name.format(layer=layer) for name in (self.q, self.k, self.v)]

    def hf_shapes(self, model: ModelConfig, megatron_shape: tuple) -> list[tuple]:
        d, rest = model.head_dim, tuple(megatron_shape[1:])
        return [(model.num_attention_heads * d * self._query_parts, *rest), (model.num_query_groups * d, *rest),
                (model.num_query_groups * d, *rest)]

    _query_parts = 1

    def to_megatron(self, tensors: list[torch.Tensor], model: ModelConfig) -> torch.Tensor:
        q, k, v = tensors
        groups, d = model.num_query_groups, model.head_dim
        rest = q.shape[1:]
        per_group = [*self._queries_to_megatron(q.reshape(groups, -1, d, *rest)), k.reshape(groups, 1, d, *rest),
                     v.reshape(groups, 1, d, *rest)]
        return torch.cat(per_group, dim=1).reshape(-1, *rest)

    def to_hf(self, tensors: list[torch.Tensor], model: ModelConfig) -> list[torch.Tensor]:
        groups, d = model.num_query_groups, model.head_dim
        query_rows = model.num_attention_heads // groups * self._query_parts
        rest = tensors[0].shape[1:]
        grouped = tensors[0].reshape(groups, query_rows + 2, d, *rest)
        q, k, v = grouped.split([query_rows, 1, 1], dim=1)
        return [t.reshape(-1, *rest).contiguous() for t in (self._queries_to_hf(q), k, v)]

    def _queries_to_megatron(self, q: torch.Tensor) -> list[torch.Tensor]:
        return [q]

    def _queries_to_hf(self, q: torch.Tensor) -> torch.Tensor:
        return q

    def row_range(self, index: int, megatron_rows: int) -> None:
        return None  # q, k and v rows interleave per group


@dataclasses.dataclass(frozen=True)
class GatedQKV(QKV):
    """QKV with the output gate (Qwen3-Next, Qwen3.5): HF's q_proj gives each head its query, then its gate;
    megatron's ``linear_qkv`` gives each query group its query heads, then their gates, then the key and the
    value head."""
    _query_parts = 2

    def _queries_to_megatron(self, q: torch.Tensor) -> list[torch.Tensor]:
        heads = q.reshape(q.shape[0], -1, 2, *q.shape[2:])  # [group, head, query | gate, d, ...]
        return [heads[:, :, 0], heads[:, :, 1]]

    def _queries_to_hf(self, q: torch.Tensor) -> torch.Tensor:
        query, gate = q.chunk(2, dim=1)
        return torch.stack([query, gate], dim=2)


@dataclasses.dataclass(frozen=True)
class GatedMLP(_OneTensor):
    """HF's gate and up projections <-> megatron's ``linear_fc1``: the gate half first (megatron's GLU
    applies the activation to the first half)."""
    megatron: str
    gate: str
    up: str

    def hf_names(self, layer: str, expert: str = "") -> list[str]:
        return [name.format(layer=layer, expert=expert) for name in (self.gate, self.up)]

    def hf_shapes(self, model: ModelConfig, megatron_shape: tuple) -> list[tuple]:
        half = (megatron_shape[0] // 2, *megatron_shape[1:])
        return [half, half]

    def to_megatron(self, tensors: list[torch.Tensor], model: ModelConfig) -> torch.Tensor:
        return torch.cat(tensors, dim=0)

    def to_hf(self, tensors: list[torch.Tensor], model: ModelConfig) -> list[torch.Tensor]:
        return [t.contiguous() for t in tensors[0].chunk(2, dim=0)]

    def row_range(self, index: int, megatron_rows: int) -> tuple[int, int]:
        return index * megatron_rows // 2, megatron_rows // 2


@dataclasses.dataclass(frozen=True)
class Sections:
    """A module megatron checkpoints as several tensors, one per section (Gated DeltaNet's ``in_proj`` and
    ``conv1d``: ``.query``, ``.key``, ``.value``, ... each split over TP alone) <-> HF tensors that hold the
    sections otherwise (side by side, or interleaved per key head). ``split`` gives the sections from the HF
    tensors, ``join`` the HF tensors from the sections (whole tensors both ways: a Gated DeltaNet projection is a
    few hundred MB at the largest); ``hf_rows`` each HF tensor's rows."""
    megatron: tuple[str, ...]
    hf: tuple[str, ...]
    split: Callable[[list[torch.Tensor], ModelConfig], list[torch.Tensor]]
    join: Callable[[list[torch.Tensor], ModelConfig], list[torch.Tensor]]
    hf_rows: Callable[[ModelConfig], list[int]]

    def parts(self) -> tuple["Section", ...]:
        """One mapping per megatron section (what the checkpoint's keys meet)."""
        return tuple(Section(self, position) for position in range(len(self.megatron)))


@dataclasses.dataclass(frozen=True)
class Section:
    """Section ``position`` of a ``Sections``. Every section reads all of the group's HF tensors; the first
    one writes them (the others list none), from every section's megatron tensor."""
    group: Sections
    position: int

    @property
    def megatron(self) -> str:
        return self.group.megatron[self.position]

    def megatron_keys(self, key: str) -> list[str]:
        stem = key[:len(key) - len(self.megatron)]
        return [stem + name for name in self.group.megatron]

    def hf_names(self, layer: str, expert: str = "") -> list[str]:
        return [name.format(layer=layer) for name in self.group.hf]

    def hf_shapes(self, model: ModelConfig, megatron_shape: tuple) -> list[tuple]:
        rest = tuple(megatron_shape[1:])
        return [(rows, *rest) for rows in self.group.hf_rows(model)] if self.position == 0 else []

    def to_megatron(self, tensors: list[torch.Tensor], model: ModelConfig) -> torch.Tensor:
        return self.group.split(tensors, model)[self.position].contiguous()

    def to_hf(self, tensors: list[torch.Tensor], model: ModelConfig) -> list[torch.Tensor]:
        return [t.contiguous() for t in self.group.join(tensors, model)]

    def row_range(self, index: int, megatron_rows: int) -> None:
        return None


Mapping = Rename | Copies | QKV | GatedMLP | Section


def per_expert(mapping: Mapping) -> bool:
    """One megatron tensor per expert (an expert axis in the checkpoint, ``{expert}`` in the HF names)."""
    return any(isinstance(value, str) and "{expert}" in value for value in vars(mapping).values())


def pick(entries: tuple, model: ModelConfig) -> list[Mapping]:
    """The mappings of ``(mapping, included for this model?)`` pairs that apply to ``model``."""
    return [m for m, applies in entries if applies(model)]


@dataclasses.dataclass(frozen=True)
class Architecture:
    """One HF architecture of GPT layers: its config.json fields beyond the shared ones (both ways) and its
    weights as (mapping, included for this model?) pairs; per-layer megatron names are relative to
    LAYER_PREFIX, HF names hold {layer} (and {expert})."""
    name: str
    settings: Callable[[dict], dict]  # config.json -> ModelConfig fields of this architecture
    config_json: Callable[[ModelConfig], dict]  # ModelConfig -> config.json fields of this architecture
    embeddings: tuple
    layer: tuple  # attention and norms: every layer
    mlp: tuple  # a dense layer's MLP
    moe: tuple = ()  # a MoE layer's router and experts

    def whole(self, model: ModelConfig) -> list[Mapping]:
        """The mappings of tensors outside the layers (embeddings, final norm, output layer)."""
        return pick(self.embeddings, model)

    def layers(self, model: ModelConfig) -> list[tuple[int, list[Mapping]]]:
        """Per megatron layer: (its HF layer, its mappings)."""
        if model.num_experts is not None and not self.moe:
            raise UnsupportedCheckpoint(f"{self.name} has no experts, this model has num_experts="
                                        f"{model.num_experts}: convert it as a MoE architecture or keep it as "
                                        "a megatron checkpoint")
        layer = pick(self.layer, model)
        dense, moe = layer + pick(self.mlp, model), layer + pick(self.moe, model)
        return [(i, moe if sparse else dense) for i, sparse in enumerate(model.moe_layer_pattern())]

"""One decoder-only transformer as plain data, and its megatron-core ``TransformerConfig``.

A ``ModelConfig`` holds only what defines the weights and the numerics (shapes, norm, activation,
positions, biases, tying); how it is trained or split across ranks is the caller's business and comes in
as ``TransformerConfig`` overrides. Named configs live in the family modules (``models/gpt.py``,
``models/qwen.py``) and are looked up through ``models.get``.
"""

from __future__ import annotations

import dataclasses

NORMALIZATIONS = ("RMSNorm", "LayerNorm")
ACTIVATIONS = ("swiglu", "gelu")
POSITION_EMBEDDINGS = ("rope", "learned_absolute")


class ModelConfigError(ValueError):
    """A model config, or a parallel layout for it, that cannot be built: says which value and the fix."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    # rows of the embedding table: the Hugging Face config's vocab_size, already padded for the kernels
    vocab_size: int
    max_position_embeddings: int
    # the training sequence length a launch script uses unless told otherwise
    seq_length: int
    normalization: str = "RMSNorm"
    norm_epsilon: float = 1e-5
    activation: str = "swiglu"
    position_embedding: str = "rope"
    rotary_base: float = 10000.0
    add_qkv_bias: bool = False
    # biases of every other linear layer (the attention output and both MLP projections)
    add_bias_linear: bool = False
    tie_embeddings: bool = False

    def __post_init__(self):
        for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                     "num_query_groups", "vocab_size", "max_position_embeddings", "seq_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ModelConfigError(f"{name}={value!r}: must be a positive integer")
        for name, allowed in (("normalization", NORMALIZATIONS), ("activation", ACTIVATIONS),
                              ("position_embedding", POSITION_EMBEDDINGS)):
            if getattr(self, name) not in allowed:
                raise ModelConfigError(f"{name}={getattr(self, name)!r}: use one of {', '.join(allowed)}")
        if self.hidden_size % self.num_attention_heads:
            raise ModelConfigError(f"hidden_size={self.hidden_size} is not divisible by "
                                   f"num_attention_heads={self.num_attention_heads}")
        if self.num_attention_heads % self.num_query_groups:
            raise ModelConfigError(f"num_attention_heads={self.num_attention_heads} is not divisible by "
                                   f"num_query_groups={self.num_query_groups}")
        if self.seq_length > self.max_position_embeddings:
            raise ModelConfigError(f"seq_length={self.seq_length} exceeds max_position_embeddings="
                                   f"{self.max_position_embeddings}: lower seq_length")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def replace(self, **overrides) -> "ModelConfig":
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ModelConfigError(f"unknown model setting(s) {', '.join(unknown)}: known are "
                                   f"{', '.join(f.name for f in dataclasses.fields(self))}")
        return dataclasses.replace(self, **overrides)

    def check_layout(self, tp: int = 1, pp: int = 1, vpp: int | None = None) -> None:
        """Refuse a tensor/pipeline layout megatron would fail on later, deep inside a layer."""
        for name in ("num_attention_heads", "num_query_groups", "ffn_hidden_size", "vocab_size"):
            value = getattr(self, name)
            if value % tp:
                raise ModelConfigError(
                    f"tensor parallel size {tp} does not divide {name}={value}: choose a TP size that "
                    f"divides {name}")
        stages = pp * (vpp or 1)
        if self.num_layers % stages:
            raise ModelConfigError(
                f"{self.num_layers} layers cannot be split evenly into {pp} pipeline stages"
                + (f" x {vpp} virtual stages" if vpp else "") + ": choose sizes whose product divides "
                f"num_layers")

    def num_parameters(self) -> int:
        """Parameter count, each tied weight counted once (as Hugging Face and megatron count)."""
        h, f, d = self.hidden_size, self.ffn_hidden_size, self.head_dim
        qkv_rows = (self.num_attention_heads + 2 * self.num_query_groups) * d
        norm = 2 * h if self.normalization == "LayerNorm" else h
        fc1_rows = 2 * f if self.activation == "swiglu" else f
        per_layer = (2 * norm + qkv_rows * h + h * h + fc1_rows * h + f * h
                     + (qkv_rows if self.add_qkv_bias else 0)
                     + (h + fc1_rows + h if self.add_bias_linear else 0))
        embeddings = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        positions = self.max_position_embeddings * h if self.position_embedding == "learned_absolute" else 0
        return self.num_layers * per_layer + norm + embeddings + positions

"""One decoder-only transformer as plain data, and its megatron-core ``TransformerConfig``.

A ``ModelConfig`` holds only what defines the weights and the numerics (shapes, norm, activation,
positions, biases, tying, the experts and how tokens are routed to them); how it is trained or split across
ranks is the caller's business and comes in as ``TransformerConfig`` overrides. Named configs live in the
family modules (``models/gpt.py``, ``models/qwen.py``) and are looked up through ``models.get``.

Mixture of Experts takes megatron-core's fields and meanings (``TransformerConfig``): ``num_experts`` routed
experts (None: a dense model) of ``moe_ffn_hidden_size`` each (None: ``ffn_hidden_size``), ``moe_router_topk``
of them per token, in the layers ``moe_layer_freq`` picks (an int N: layers 0, N, 2N, ...; or one 0/1 per
layer), plus an optional shared expert every token passes through (``moe_shared_expert_intermediate_size``,
gated by ``sigmoid(x @ w)`` with ``moe_shared_expert_gate``). The router, as megatron-core 0.16.1's
``topk_routing_with_score_function`` computes it:

- ``softmax`` with ``moe_router_pre_softmax``: softmax over all experts, then the top k, not renormalised
  (Qwen2-MoE and DeepSeek-V2, ``norm_topk_prob=False``);
- ``softmax`` without it: the top k logits, then a softmax over those k, which equals the top k of the full
  softmax renormalised to 1 (Mixtral, Qwen3-MoE, ``norm_topk_prob=True``); with k = 1 that is always 1 and
  gives the router no gradient, so megatron refuses it;
- ``sigmoid``: per-expert sigmoid scores, the top k (chosen by score + ``expert_bias`` with
  ``moe_router_enable_expert_bias``, DeepSeek-V3's aux-loss-free balancing), renormalised when k > 1;
  ``moe_router_pre_softmax`` changes nothing here;
- ``moe_router_topk_scaling_factor`` then multiplies the probabilities, whichever path (DeepSeek's
  ``routed_scaling_factor``);
- ``moe_router_num_groups`` / ``moe_router_group_topk``: group-limited routing (DeepSeek-V3's ``n_group`` /
  ``topk_group``): the experts fall into equal groups, each token keeps the best groups and picks its top k
  among their experts.

Multi-latent attention (DeepSeek-V2/V3, Kimi-K2) takes megatron's ``MLATransformerConfig`` fields and meanings
(Megatron-LM's flags of the same names): queries through a low-rank ``q_lora_rank`` bottleneck (None: one
projection, with no norm before it, as DeepSeek-V2-Lite: adapter/latent_attention.py), keys and values through
a shared ``kv_lora_rank`` latent, each head's query/key split into ``qk_head_dim`` dimensions without position
and ``qk_pos_emb_head_dim`` with RoPE, values of ``v_head_dim``.
Its RoPE is megatron's YaRN (``rotary_scaling_factor``, ``mscale``, ``mscale_all_dim``,
``original_max_position_embeddings``, ``beta_fast``, ``beta_slow``; a factor of 1 is plain RoPE).
``mtp_num_layers`` multi-token prediction layers (megatron's MTP block; DeepSeek-V3's
``num_nextn_predict_layers``) follow the decoder and share its embedding and output layer.
"""

from __future__ import annotations

import dataclasses

from adapter.parallel import ModelShape, ParallelConfigError, PipelineSplit, check_sizes

NORMALIZATIONS = ("RMSNorm", "LayerNorm")
# a hybrid model's token mixers (Hugging Face's layer_types): Gated DeltaNet, or softmax attention
LINEAR_ATTENTION, FULL_ATTENTION = "linear_attention", "full_attention"
HYBRID_FIELDS = ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
                 "linear_num_value_heads")
ACTIVATIONS = ("swiglu", "gelu")
POSITION_EMBEDDINGS = ("rope", "learned_absolute")
SCORE_FUNCTIONS = ("softmax", "sigmoid")


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
    # a norm over each head's queries and keys, of the head size (Qwen3)
    qk_layernorm: bool = False
    # each attention head's size, megatron's kv_channels (HF head_dim); None: hidden_size / heads
    kv_channels: int | None = None
    # Mixture of Experts, megatron's meanings (module docstring); num_experts None is a dense model
    num_experts: int | None = None
    moe_ffn_hidden_size: int | None = None
    moe_router_topk: int = 2
    moe_layer_freq: int | tuple[int, ...] = 1
    moe_shared_expert_intermediate_size: int | None = None
    moe_shared_expert_gate: bool = False
    moe_router_score_function: str = "softmax"
    moe_router_pre_softmax: bool = False
    moe_router_topk_scaling_factor: float | None = None
    moe_router_enable_expert_bias: bool = False
    # the load-balancing loss coefficient the model was published with (HF router_aux_loss_coef), which a
    # training run uses unless told otherwise (megatron's moe_aux_loss_coeff)
    moe_aux_loss_coeff: float = 0.0
    # Hybrid models (Qwen3.5, Qwen3-Next; megatron's HybridModel): each layer's token mixer, LINEAR_ATTENTION
    # (Gated DeltaNet) or FULL_ATTENTION, then its MLP or MoE block; None is a GPT stack (attention everywhere)
    layer_types: tuple[str, ...] | None = None
    # Gated DeltaNet's sizes, megatron's linear_* fields (hybrid models only; the defaults are megatron's)
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    # the attention output times sigmoid(a per-head gate projected beside the queries) (Qwen3-Next, Qwen3.5)
    attention_output_gate: bool = False
    # every norm stores gamma - 1 and scales by 1 + weight (megatron's layernorm_zero_centered_gamma)
    zero_centered_norm: bool = False
    # the share of each head's dimensions RoPE turns (HF partial_rotary_factor; megatron's rotary_percent)
    rotary_percent: float = 1.0
    # group-limited routing (module docstring); None: plain top-k over every expert
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    # multi-latent attention, megatron's MLATransformerConfig fields (module docstring); the defaults are
    # Megatron-LM's flags' (its rotary_scaling_factor 1, mscale_all_dim 0), the YaRN ones MLATransformerConfig's
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int = 32
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    rotary_scaling_factor: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    # multi-token prediction layers after the decoder (megatron's mtp_num_layers); None: none
    mtp_num_layers: int | None = None

    def __post_init__(self):
        for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                     "num_query_groups", "vocab_size", "max_position_embeddings", "seq_length"):
            _positive(name, getattr(self, name))
        for name, allowed in (("normalization", NORMALIZATIONS), ("activation", ACTIVATIONS),
                              ("position_embedding", POSITION_EMBEDDINGS)):
            if getattr(self, name) not in allowed:
                raise ModelConfigError(f"{name}={getattr(self, name)!r}: use one of {', '.join(allowed)}")
        if self.kv_channels is not None:
            _positive("kv_channels", self.kv_channels)
        elif self.hidden_size % self.num_attention_heads:
            raise ModelConfigError(f"hidden_size={self.hidden_size} is not divisible by "
                                   f"num_attention_heads={self.num_attention_heads}: set kv_channels (the "
                                   "head size) explicitly")
        if self.num_attention_heads % self.num_query_groups:
            raise ModelConfigError(f"num_attention_heads={self.num_attention_heads} is not divisible by "
                                   f"num_query_groups={self.num_query_groups}")
        if self.seq_length > self.max_position_embeddings:
            raise ModelConfigError(f"seq_length={self.seq_length} exceeds max_position_embeddings="
                                   f"{self.max_position_embeddings}: lower seq_length")
        # one spelling per model, so that equal weights compare equal: a list pattern as a tuple, and no
        # shared expert as None (megatron's "none"; 0 reads the same)
        if isinstance(self.moe_layer_freq, list):
            object.__setattr__(self, "moe_layer_freq", tuple(self.moe_layer_freq))
        if isinstance(self.layer_types, list):
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        self._check_mixers()
        self._check_latent_attention()
        if self.moe_shared_expert_intermediate_size == 0:
            object.__setattr__(self, "moe_shared_expert_intermediate_size", None)
        if self.kv_channels is not None and self.kv_channels * self.num_attention_heads == self.hidden_size:
            object.__setattr__(self, "kv_channels", None)
        if self.num_experts is None:
            self._check_dense()
        else:
            self._check_experts()
            self._check_router()

    def _check_mixers(self) -> None:
        if not 0 < self.rotary_percent <= 1:
            raise ModelConfigError(f"rotary_percent={self.rotary_percent!r}: a share of the head, in (0, 1]")
        if self.layer_types is None:
            given = [f"{name}={getattr(self, name)!r}" for name in HYBRID_FIELDS
                     if getattr(self, name) != _FIELD_DEFAULTS[name]]
            if given:
                raise ModelConfigError(f"{', '.join(given)} without layer_types: Gated DeltaNet sizes are for hybrid "
                                       "models; set layer_types or leave them at their defaults")
            return
        kinds = set(self.layer_types) - {LINEAR_ATTENTION, FULL_ATTENTION}
        if len(self.layer_types) != self.num_layers or kinds:
            raise ModelConfigError(f"layer_types={list(self.layer_types)}: one of {LINEAR_ATTENTION!r} or "
                                   f"{FULL_ATTENTION!r} per layer, {self.num_layers} in all")
        for name in HYBRID_FIELDS:
            _positive(name, getattr(self, name))
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ModelConfigError(f"linear_num_value_heads={self.linear_num_value_heads} is not a multiple of "
                                   f"linear_num_key_heads={self.linear_num_key_heads}")

    def _check_latent_attention(self) -> None:
        """MLA's sizes are positive and come with ``multi_latent_attention``; MLA has one key/value latent for
        every head (megatron refuses grouped-query attention with it) and no output gate."""
        if self.mtp_num_layers is not None:
            _positive("mtp_num_layers", self.mtp_num_layers)
        if not self.multi_latent_attention:
            given = [f"{name}={getattr(self, name)!r}" for name in MLA_FIELDS
                     if getattr(self, name) != _FIELD_DEFAULTS[name]]
            if given:
                raise ModelConfigError(f"{', '.join(given)} without multi_latent_attention: these are multi-latent "
                                       "attention's sizes; set multi_latent_attention=True or leave them at their "
                                       "defaults")
            return
        for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
                     "original_max_position_embeddings"):
            _positive(name, getattr(self, name))
        if self.q_lora_rank is not None:
            _positive("q_lora_rank", self.q_lora_rank)
        if self.num_query_groups != self.num_attention_heads:
            raise ModelConfigError(f"multi_latent_attention with num_query_groups={self.num_query_groups} of "
                                   f"{self.num_attention_heads} heads: MLA has no grouped-query attention (megatron "
                                   "refuses it); set num_query_groups to the number of heads")
        given = [f"{name}={getattr(self, name)!r}" for name, fits in (
            ("attention_output_gate", False), ("layer_types", None), ("position_embedding", "rope"),
            ("add_qkv_bias", False)) if getattr(self, name) != fits]
        if given:
            raise ModelConfigError(f"multi_latent_attention with {', '.join(given)}: megatron's MLA is a GPT stack's "
                                   "attention with its own RoPE, no output gate and no query/key/value biases")
        if not self.rotary_scaling_factor >= 1:
            raise ModelConfigError(f"rotary_scaling_factor={self.rotary_scaling_factor!r}: YaRN's factor is at "
                                   "least 1 (1: plain RoPE)")

    def _check_dense(self) -> None:
        """A dense model carries no expert settings: one set without ``num_experts`` is a mistake, not a
        choice megatron would honour."""
        given = [f"{name}={getattr(self, name)!r}" for name, default in _FIELD_DEFAULTS.items()
                 if name.startswith("moe_") and getattr(self, name) != default]
        if given:
            raise ModelConfigError(f"{', '.join(given)} on a dense model (num_experts=None): set num_experts, or "
                                   "leave the MoE settings at their defaults")

    def _check_experts(self) -> None:
        _positive("num_experts", self.num_experts)
        for name in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        freq = self.moe_layer_freq
        if isinstance(freq, tuple):
            if len(freq) != self.num_layers or set(freq) - {0, 1} or 1 not in freq:
                raise ModelConfigError(
                    f"moe_layer_freq={list(freq)}: a pattern needs one 0 (dense) or 1 (MoE) per layer, "
                    f"{self.num_layers} in all, with at least one 1")
        else:
            _positive("moe_layer_freq", freq)
        if self.moe_shared_expert_gate and self.moe_shared_expert_intermediate_size is None:
            raise ModelConfigError("moe_shared_expert_gate=True without a shared expert: set "
                                   "moe_shared_expert_intermediate_size")
        if self.moe_shared_expert_intermediate_size is not None and self.add_bias_linear:
            raise ModelConfigError("a shared expert with add_bias_linear=True: megatron's shared experts have "
                                   "no biases; set add_bias_linear=False or drop the shared expert")

    def _check_router(self) -> None:
        _positive("moe_router_topk", self.moe_router_topk)
        if self.moe_router_topk > self.num_experts:
            raise ModelConfigError(f"moe_router_topk={self.moe_router_topk} exceeds num_experts="
                                   f"{self.num_experts}: route each token to at most that many experts")
        if self.moe_router_score_function not in SCORE_FUNCTIONS:
            raise ModelConfigError(f"moe_router_score_function={self.moe_router_score_function!r}: use one of "
                                   f"{', '.join(SCORE_FUNCTIONS)}")
        if (self.moe_router_topk == 1 and self.moe_router_score_function == "softmax"
                and not self.moe_router_pre_softmax):
            raise ModelConfigError("moe_router_topk=1 with the softmax after the top-k gives every token a "
                                   "probability of 1 and the router no gradient: set moe_router_pre_softmax=True")
        if self.moe_router_enable_expert_bias and self.moe_router_score_function != "sigmoid":
            raise ModelConfigError("moe_router_enable_expert_bias=True needs moe_router_score_function='sigmoid' "
                                   "(megatron's aux-loss-free balancing biases sigmoid scores)")
        if not self.moe_aux_loss_coeff >= 0:
            raise ModelConfigError(f"moe_aux_loss_coeff={self.moe_aux_loss_coeff!r}: must be zero or more")
        factor = self.moe_router_topk_scaling_factor
        if factor is not None and not factor > 0:
            raise ModelConfigError(f"moe_router_topk_scaling_factor={factor!r}: must be positive, or None for "
                                   "no scaling")
        self._check_group_limited_routing()

    def _check_group_limited_routing(self) -> None:
        """megatron's group-limited top-k: equal groups of experts, and each token's top k spread evenly over
        the groups it keeps."""
        groups, picked = self.moe_router_num_groups, self.moe_router_group_topk
        if groups is None and picked is None:
            return
        if groups is None or picked is None:
            raise ModelConfigError("moe_router_num_groups and moe_router_group_topk go together: give both")
        _positive("moe_router_num_groups", groups)
        _positive("moe_router_group_topk", picked)
        if self.num_experts % groups:
            raise ModelConfigError(f"moe_router_num_groups={groups} does not divide the {self.num_experts} experts")
        if picked > groups or self.moe_router_topk % picked:
            raise ModelConfigError(f"moe_router_group_topk={picked}: must be at most moe_router_num_groups={groups} "
                                   f"and divide moe_router_topk={self.moe_router_topk}")

    @property
    def head_dim(self) -> int:
        """Each attention head's size: ``kv_channels`` where set (Qwen3: 128 whatever the hidden size)."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def expert_ffn_hidden_size(self) -> int:
        """Each routed expert's FFN size: megatron's ``moe_ffn_hidden_size``, which defaults to the FFN's."""
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    def moe_layer_pattern(self) -> tuple[int, ...]:
        """1 for each layer whose MLP is a MoE layer, 0 for a dense one, as megatron reads moe_layer_freq."""
        if self.num_experts is None:
            return (0,) * self.num_layers
        if isinstance(self.moe_layer_freq, tuple):
            return self.moe_layer_freq
        return tuple(int(i % self.moe_layer_freq == 0) for i in range(self.num_layers))

    def replace(self, **overrides) -> "ModelConfig":
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ModelConfigError(f"unknown model setting(s) {', '.join(unknown)}: known are "
                                   f"{', '.join(f.name for f in dataclasses.fields(self))}")
        return dataclasses.replace(self, **overrides)

    def check_layout(self, tp: int = 1, pp: int = 1, vpp: int | None = None, ep: int = 1,
                     etp: int | None = None, cp: int = 1, split: PipelineSplit = PipelineSplit()) -> None:
        """Refuse a tensor/pipeline/expert/context layout megatron would fail on later, deep inside a layer:
        the rules are ``adapter.parallel.check_sizes``', over this model's ``shape``. ``etp`` (expert tensor
        parallel) defaults to ``tp``, as in megatron."""
        try:
            check_sizes(None, tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp, cp=cp, model=self.shape(), split=split)
        except ParallelConfigError as exc:
            raise ModelConfigError(str(exc)) from None

    def shape(self) -> ModelShape:
        """What of this model a parallel layout must divide."""
        moe = self.num_experts is not None
        return ModelShape(num_layers=self.num_layers, num_attention_heads=self.num_attention_heads,
                          num_query_groups=self.num_query_groups, vocab_size=self.vocab_size,
                          ffn_hidden_size=self.ffn_hidden_size if 0 in self.moe_layer_pattern() else None,
                          num_experts=self.num_experts, expert_ffn_hidden_size=self.expert_ffn_hidden_size if moe
                          else None, moe_shared_expert_intermediate_size=self.moe_shared_expert_intermediate_size if moe
                          else None, expert_bias=self.add_bias_linear, seq_length=self.seq_length,
                          linear_attention_heads=(self.linear_num_key_heads, self.linear_num_value_heads)
                          if LINEAR_ATTENTION in self.mixers() else None)

    def num_parameters(self) -> int:
        """Parameter count, each tied weight counted once (as Hugging Face and megatron count), every expert
        included."""
        h = self.hidden_size
        norm = 2 * h if self.normalization == "LayerNorm" else h
        layers = sum(self.layer_parameters(moe, mixer) for moe, mixer in zip(self.moe_layer_pattern(), self.mixers()))
        embeddings = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        positions = self.max_position_embeddings * h if self.position_embedding == "learned_absolute" else 0
        return layers + norm + embeddings + positions + (self.mtp_num_layers or 0) * self.mtp_layer_parameters()

    def mtp_layer_parameters(self) -> int:
        """One multi-token prediction layer as megatron builds it: the norms of the embedding and of the
        hidden state, their projection from 2h to h, a decoder layer like the last one, and its final norm;
        the embedding and the output layer are the model's own."""
        h = self.hidden_size
        norm = 2 * h if self.normalization == "LayerNorm" else h
        return 3 * norm + 2 * h * h + self.layer_parameters(bool(self.moe_layer_pattern()[-1]))

    def num_active_parameters(self) -> int:
        """The parameters one token passes through (DeepSeek's "activated"): every expert's but those of the
        routed experts it is not sent to."""
        idle = (self.num_experts or 0) - self.moe_router_topk
        moe_layers = sum(self.moe_layer_pattern()) + (self.mtp_num_layers or 0) * self.moe_layer_pattern()[-1]
        return self.num_parameters() - moe_layers * idle * self.mlp_parameters(self.expert_ffn_hidden_size)

    @property
    def megatron_num_layers(self) -> int:
        """megatron's layer count: a hybrid model's token mixers and MLP/MoE blocks are layers of their own."""
        return 2 * self.num_layers if self.layer_types else self.num_layers

    def megatron_moe_layers(self) -> dict[int, int]:
        """megatron's 0-based index of each MoE layer -> this model's layer it belongs to."""
        step = 2 if self.layer_types else 1
        return {step * i + step - 1: i for i, moe in enumerate(self.moe_layer_pattern()) if moe}

    def mixers(self) -> tuple[str, ...]:
        """Each layer's token mixer: ``layer_types``, or attention in every layer of a GPT stack."""
        return self.layer_types or (FULL_ATTENTION,) * self.num_layers

    def layer_parameters(self, moe: bool, mixer: str = FULL_ATTENTION) -> int:
        """One layer's parameters: its two norms, its token mixer and a dense MLP or a MoE block."""
        norm = 2 * self.hidden_size if self.normalization == "LayerNorm" else self.hidden_size
        mixing = (self.gated_delta_net_parameters() if mixer != FULL_ATTENTION else
                  self.latent_attention_parameters() if self.multi_latent_attention else self.attention_parameters())
        return 2 * norm + mixing + (self.moe_parameters() if moe else self.mlp_parameters(self.ffn_hidden_size))

    @property
    def qkv_rows(self) -> int:
        """Rows of the fused QKV projection: every query head, the output gate's beside them if any, and each
        query group's key and value head."""
        heads = self.num_attention_heads * (2 if self.attention_output_gate else 1)
        return (heads + 2 * self.num_query_groups) * self.head_dim

    def attention_parameters(self) -> int:
        """Attention: the QKV projection (with the output gate's rows beside the queries, if any), its bias,
        the QK norms and the output projection with its bias."""
        h, d, qkv_rows = self.hidden_size, self.head_dim, self.qkv_rows
        qk_norms = 2 * (2 * d if self.normalization == "LayerNorm" else d) if self.qk_layernorm else 0
        return (qkv_rows * h + self.num_attention_heads * d * h + (qkv_rows if self.add_qkv_bias else 0)
                + (h if self.add_bias_linear else 0) + qk_norms)

    def latent_attention_parameters(self) -> int:
        """Multi-latent attention: the query projection (down to q_lora_rank, its norm, and up; or one
        projection), the key/value down projection to the latent and the RoPE key, the latent's norm, its up
        projection to each head's key and value, and the output projection (the one with a bias, if any). The two
        norms are the QK norms (megatron's qk_layernorm)."""
        h, heads = self.hidden_size, self.num_attention_heads
        q_head = self.qk_head_dim + self.qk_pos_emb_head_dim
        norm = (2 if self.normalization == "LayerNorm" else 1) if self.qk_layernorm else 0
        if self.q_lora_rank is None:
            query = h * heads * q_head
        else:
            query = h * self.q_lora_rank + norm * self.q_lora_rank + self.q_lora_rank * heads * q_head
        kv = (h * (self.kv_lora_rank + self.qk_pos_emb_head_dim) + norm * self.kv_lora_rank
              + self.kv_lora_rank * heads * (self.qk_head_dim + self.v_head_dim))
        return query + kv + heads * self.v_head_dim * h + (h if self.add_bias_linear else 0)

    def gated_delta_net_parameters(self) -> int:
        """Gated DeltaNet: the input projection to q, k, v, the output gate z and each value head's beta and
        decay rate, the causal convolution over q, k and v, each value head's A_log and dt_bias, the output
        norm over a value head, and the output projection."""
        qk = self.linear_key_head_dim * self.linear_num_key_heads
        v, heads = self.linear_value_head_dim * self.linear_num_value_heads, self.linear_num_value_heads
        return ((2 * qk + 2 * v + 2 * heads) * self.hidden_size + (2 * qk + v) * self.linear_conv_kernel_dim
                + 2 * heads + self.linear_value_head_dim + v * self.hidden_size)

    def mlp_parameters(self, ffn: int) -> int:
        """An MLP of FFN size ``ffn``: FC1 (two halves with SwiGLU) and FC2, with their biases if any."""
        fc1_rows = 2 * ffn if self.activation == "swiglu" else ffn
        biases = fc1_rows + self.hidden_size if self.add_bias_linear else 0
        return fc1_rows * self.hidden_size + ffn * self.hidden_size + biases

    def moe_parameters(self) -> int:
        """A MoE block: the router (one row per expert), every routed expert, the shared expert and its gate."""
        h = self.hidden_size
        router = self.num_experts * (h + (1 if self.add_bias_linear else 0))
        shared = self.moe_shared_expert_intermediate_size
        return (router + self.num_experts * self.mlp_parameters(self.expert_ffn_hidden_size)
                + (self.mlp_parameters(shared) if shared else 0) + (h if self.moe_shared_expert_gate else 0))


_FIELD_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
              "rotary_scaling_factor", "mscale", "mscale_all_dim", "original_max_position_embeddings", "beta_fast",
              "beta_slow")


def moe_layer_freq_of(hf: dict) -> int | tuple[int, ...]:
    """megatron's ``moe_layer_freq`` of a Hugging Face MoE config.json (Qwen3-MoE, Qwen3-Next): layer i is sparse
    unless listed in ``mlp_only_layers``, when (i + 1) is a multiple of ``decoder_sparse_step``; 1 where every
    layer is."""
    step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or ())
    pattern = tuple(int(i not in dense and (i + 1) % step == 0) for i in range(hf["num_hidden_layers"]))
    return 1 if all(pattern) else pattern


def _positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ModelConfigError(f"{name}={value!r}: must be a positive integer")

"""DeepSeek-V3 (and Kimi-K2, published as ``DeepseekV3ForCausalLM`` too) as Hugging Face checkpoints: their
config.json as a ``ModelConfig`` and back, and their weights in megatron's multi-latent attention layout.

What carries over as it is (megatron's ``MLASelfAttention`` splits its projections as transformers'
``DeepseekV3Attention`` does): ``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj`` (or ``q_proj`` without a query
LoRA, DeepSeek-V2-Lite style, with no norm before it: adapter/latent_attention.py keeps megatron-core 0.19 from
adding one) are megatron's ``linear_q_down_proj`` / ``q_layernorm`` / ``linear_q_up_proj`` (``linear_q_proj``),
each head's rows its qk_nope dimensions then its RoPE ones; ``kv_a_proj_with_mqa`` is ``linear_kv_down_proj`` (the
kv_lora_rank latent rows, then the shared RoPE key's), ``kv_a_layernorm`` is ``kv_layernorm``, ``kv_b_proj``
is ``linear_kv_up_proj`` (per head: key rows, then value rows). The RoPE dimensions stay as DeepSeek lays
them out, in interleaved pairs: megatron's MLA always de-interleaves them before rotating
(``mla_rotary_interleaved``), as transformers does with ``rope_interleave`` (its default, and every published
checkpoint's); a checkpoint without it is refused. The router's ``gate.weight`` and ``e_score_correction_bias``
are megatron's ``router.weight`` and ``router.expert_bias`` (both float32 in DeepSeek's checkpoint and in
megatron's model: the converter keeps each tensor's dtype).

RoPE: DeepSeek's YaRN (``rope_scaling`` type yarn: factor, mscale, mscale_all_dim,
original_max_position_embeddings, beta_fast, beta_slow) is megatron's (``rotary_scaling_factor`` and the same
names); both scale cos/sin by mscale(factor, mscale) / mscale(factor, mscale_all_dim) and the softmax by
mscale(factor, mscale_all_dim)^2. transformers ignores ``mscale`` without ``mscale_all_dim`` (megatron would
not): that pair is refused, as is a YaRN without truncated correction bounds.

Multi-token prediction: HF keeps MTP layer k after the decoder as ``model.layers.<num_hidden_layers + k>``:
a decoder layer, ``enorm``, ``hnorm``, ``eh_proj`` (over [enorm(embedding of the next token), hnorm(hidden)],
megatron's order too), ``shared_head.norm`` (megatron's ``final_layernorm``) and its own copies of the
embedding (``embed_tokens``) and output head (``shared_head.head``), which megatron's MTP shares with the model:
those copies must equal the model's (``weight_mappings.Copies``). megatron's keys are ``mtp.layers.<k>.*``,
the decoder layer's under ``transformer_layer.``.

The router: sigmoid scores, the top k chosen by score + bias within the ``topk_group`` best of ``n_group``
groups, each group rated by the sum of its best two (megatron: its best ``topk // group_topk``, so a
group-limited config needs topk = 2 x topk_group), renormalised (``norm_topk_prob``; megatron renormalises
whenever k > 1) and scaled by ``routed_scaling_factor``.
"""

from __future__ import annotations

import dataclasses

from .config import ModelConfig, ModelConfigError
from .weight_mappings import Copies, GatedMLP, Mapping, Rename, UnsupportedCheckpoint, pick

DEEPSEEK_V3 = "DeepseekV3ForCausalLM"
_YARN_DEFAULTS = dict(mscale=1.0, mscale_all_dim=0.0, original_max_position_embeddings=4096, beta_fast=32.0,
                      beta_slow=1.0)


# ---------------------------------------------------------------------------------------------------------
# config.json <-> ModelConfig

def _rope(hf: dict) -> tuple[float, dict]:
    """(rope_theta, the YaRN fields of ModelConfig) of a config.json: published configs say ``rope_scaling``
    and ``rope_theta``, transformers 5 writes ``rope_parameters`` holding both."""
    scaling = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    theta = float(hf.get("rope_theta", scaling.get("rope_theta", 10000.0)))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in (None, "default"):
        return theta, {}
    if kind != "yarn":
        raise UnsupportedCheckpoint(f"rope scaling {kind!r} is not supported: DeepSeek's multi-latent attention "
                                    "takes plain RoPE or YaRN")
    if scaling.get("attention_factor") is not None or scaling.get("truncate", True) is not True:
        raise UnsupportedCheckpoint("YaRN with attention_factor or truncate=false is not supported: megatron "
                                    "derives the attention factor from mscale and truncates the correction range")
    original = int(scaling.get("original_max_position_embeddings") or 4096)
    factor = scaling.get("factor") or hf["max_position_embeddings"] / original
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if not (mscale and mscale_all_dim):
        if mscale_all_dim:
            raise UnsupportedCheckpoint(f"YaRN with mscale_all_dim={mscale_all_dim} but no mscale: transformers "
                                        "then scales cos/sin by mscale(factor) alone, which megatron cannot")
        mscale, mscale_all_dim = 1.0, 0.0  # what transformers computes without the pair
    return theta, dict(rotary_scaling_factor=float(factor), mscale=float(mscale),
                       mscale_all_dim=float(mscale_all_dim), original_max_position_embeddings=original,
                       beta_fast=float(scaling.get("beta_fast") or 32), beta_slow=float(scaling.get("beta_slow") or 1))


def _refuse_what_megatron_cannot_express(hf: dict) -> None:
    for name, allowed in (("hidden_act", ("silu",)), ("attention_bias", (False,)), ("rope_interleave", (True,)),
                          ("scoring_func", ("sigmoid",)), ("topk_method", ("noaux_tc",))):
        if name in hf and hf[name] not in allowed:
            raise UnsupportedCheckpoint(
                f"{DEEPSEEK_V3} with {name}={hf[name]!r} is not supported: megatron's DeepSeek-V3 path takes "
                f"{name}={allowed[0]!r} (SwiGLU, bias-free MLA with interleaved RoPE pairs, a sigmoid router with "
                "the aux-loss-free expert bias)")


def _moe_settings(hf: dict) -> dict:
    """The experts and the router in megatron's terms; none where every layer is dense."""
    layers, dense = hf["num_hidden_layers"], hf.get("first_k_dense_replace", 0)
    experts = hf.get("n_routed_experts")
    if not experts or dense >= layers:
        return {}
    topk, shared = hf["num_experts_per_tok"], hf.get("n_shared_experts") or 0
    if hf.get("norm_topk_prob", True) != (topk > 1):
        raise UnsupportedCheckpoint(f"norm_topk_prob={hf.get('norm_topk_prob')} with num_experts_per_tok={topk}: "
                                    "megatron's sigmoid router renormalises the top k exactly when k > 1")
    groups, kept = hf.get("n_group") or 1, hf.get("topk_group") or 1
    grouped = 1 < groups and kept < groups
    if grouped and topk != 2 * kept:
        raise UnsupportedCheckpoint(f"n_group={groups}, topk_group={kept} with num_experts_per_tok={topk}: "
                                    "transformers rates each group by its best 2 experts, megatron by its best "
                                    "topk // topk_group; they agree only when num_experts_per_tok = 2 x topk_group")
    scaling = float(hf.get("routed_scaling_factor", 1.0))
    return dict(num_experts=experts, moe_ffn_hidden_size=hf["moe_intermediate_size"], moe_router_topk=topk,
                moe_layer_freq=(0,) * dense + (1,) * (layers - dense) if dense else 1,
                moe_shared_expert_intermediate_size=shared * hf["moe_intermediate_size"] or None,
                moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                moe_router_topk_scaling_factor=None if scaling == 1.0 else scaling,
                moe_router_num_groups=groups if grouped else None, moe_router_group_topk=kept if grouped else None,
                moe_aux_loss_coeff=float(hf.get("aux_loss_alpha", 0.0)))


def config_from_hf(hf: dict) -> ModelConfig:
    """The ModelConfig of a DeepseekV3ForCausalLM config.json (DeepSeek-V3/R1, Kimi-K2)."""
    _refuse_what_megatron_cannot_express(hf)
    try:
        theta, yarn = _rope(hf)
        heads, positions = hf["num_attention_heads"], hf.get("max_position_embeddings", 4096)
        mtp = hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers")) or None
        return ModelConfig(
            num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"], ffn_hidden_size=hf["intermediate_size"],
            num_attention_heads=heads, num_query_groups=heads, vocab_size=hf["vocab_size"],
            max_position_embeddings=positions, seq_length=min(4096, positions), normalization="RMSNorm",
            norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)), activation="swiglu", position_embedding="rope",
            rotary_base=theta, tie_embeddings=bool(hf.get("tie_word_embeddings", False)), qk_layernorm=True,
            multi_latent_attention=True, q_lora_rank=hf.get("q_lora_rank"), kv_lora_rank=hf["kv_lora_rank"],
            qk_head_dim=hf["qk_nope_head_dim"], qk_pos_emb_head_dim=hf["qk_rope_head_dim"],
            v_head_dim=hf["v_head_dim"], mtp_num_layers=mtp, **yarn, **_moe_settings(hf))
    except KeyError as exc:
        raise UnsupportedCheckpoint(f"config.json lacks {exc.args[0]!r}") from exc
    except ModelConfigError as exc:
        raise UnsupportedCheckpoint(f"config.json: {exc}") from exc


def fits(model: ModelConfig) -> bool:
    """Whether ``model`` is one ``DeepseekV3ForCausalLM`` can hold (``config_json`` says why not)."""
    return model.multi_latent_attention


def config_json(model: ModelConfig) -> dict:
    """DeepseekV3ForCausalLM's config.json fields for a megatron MLA model (as DeepSeek publishes them: rope_scaling
    beside rope_theta); what it has no field for is refused by name."""
    _check_expressible(model)
    yarn = {name: getattr(model, name) for name in _YARN_DEFAULTS}
    config = {
        "architectures": [DEEPSEEK_V3], "model_type": "deepseek_v3", "hidden_act": "silu",
        "num_hidden_layers": model.num_layers, "hidden_size": model.hidden_size,
        "intermediate_size": model.ffn_hidden_size, "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.num_attention_heads, "vocab_size": model.vocab_size,
        "max_position_embeddings": model.max_position_embeddings, "rms_norm_eps": model.norm_epsilon,
        "tie_word_embeddings": model.tie_embeddings, "attention_bias": False, "attention_dropout": 0.0,
        "q_lora_rank": model.q_lora_rank, "kv_lora_rank": model.kv_lora_rank, "qk_nope_head_dim": model.qk_head_dim,
        "qk_rope_head_dim": model.qk_pos_emb_head_dim, "v_head_dim": model.v_head_dim, "rope_interleave": True,
        "rope_theta": model.rotary_base,
        "rope_scaling": {"type": "yarn", "factor": model.rotary_scaling_factor, **yarn},
        "num_nextn_predict_layers": model.mtp_num_layers or 0, "initializer_range": 0.02, "use_cache": True,
    }
    return {**config, **_moe_json(model)}


def _check_expressible(model: ModelConfig) -> None:
    problems = [text for bad, text in (
        (not model.multi_latent_attention, "no multi-latent attention"),
        (not model.qk_layernorm, "no norms over the query and key/value latents (qk_layernorm=False)"),
        (model.rotary_percent != 1, f"rotary_percent={model.rotary_percent}"),
        (model.mscale != 1 and not model.mscale_all_dim, f"mscale={model.mscale} without mscale_all_dim"),
        (model.zero_centered_norm, "zero-centred norms")) if bad]
    if model.num_experts is not None:
        pattern, first = model.moe_layer_pattern(), model.moe_layer_pattern().index(1)
        problems += [text for bad, text in (
            (pattern != (0,) * first + (1,) * (model.num_layers - first),
             f"MoE layers {list(pattern)} that are not the dense-first pattern"),
            (model.moe_router_score_function != "sigmoid" or not model.moe_router_enable_expert_bias,
             "a router without sigmoid scores and the expert bias"),
            (model.moe_shared_expert_intermediate_size is None or model.moe_shared_expert_gate
             or model.moe_shared_expert_intermediate_size % model.expert_ffn_hidden_size,
             "no ungated shared expert a multiple of the expert size"),
            (model.moe_router_num_groups is not None and model.moe_router_topk != 2 * model.moe_router_group_topk,
             "group-limited routing with topk != 2 x group_topk")) if bad]
    if problems:
        raise UnsupportedCheckpoint(f"this model has {'; '.join(problems)}: {DEEPSEEK_V3} cannot hold it; keep it as "
                                    "a megatron checkpoint")


def _moe_json(model: ModelConfig) -> dict:
    if model.num_experts is None:  # every layer dense; transformers still wants (unused) expert fields
        return {"first_k_dense_replace": model.num_layers, "n_routed_experts": 1, "num_experts_per_tok": 1,
                "n_shared_experts": 0, "n_group": 1, "topk_group": 1}
    groups = model.moe_router_num_groups
    return {"first_k_dense_replace": model.moe_layer_pattern().index(1), "n_routed_experts": model.num_experts,
            "moe_intermediate_size": model.expert_ffn_hidden_size, "num_experts_per_tok": model.moe_router_topk,
            "n_shared_experts": model.moe_shared_expert_intermediate_size // model.expert_ffn_hidden_size,
            "norm_topk_prob": model.moe_router_topk > 1, "n_group": groups or 1,
            "topk_group": model.moe_router_group_topk or 1, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
            "routed_scaling_factor": model.moe_router_topk_scaling_factor or 1.0,
            "aux_loss_alpha": model.moe_aux_loss_coeff}


# ---------------------------------------------------------------------------------------------------------
# weight mappings

_ALWAYS = lambda model: True  # noqa: E731
_HF = "model.layers.{layer}."
_q_lora = lambda model: model.q_lora_rank is not None  # noqa: E731
_no_q_lora = lambda model: model.q_lora_rank is None  # noqa: E731


def _layer(prefix: str) -> tuple[tuple, tuple, tuple]:
    """(attention and norms, dense MLP, MoE) of a decoder layer whose megatron names start with ``prefix``."""
    attention = tuple((Rename(prefix + m, _HF + h), when) for m, h, when in (
        ("input_layernorm.weight", "input_layernorm.weight", _ALWAYS),
        ("self_attention.linear_q_down_proj.weight", "self_attn.q_a_proj.weight", _q_lora),
        ("self_attention.q_layernorm.weight", "self_attn.q_a_layernorm.weight", _q_lora),
        ("self_attention.linear_q_up_proj.weight", "self_attn.q_b_proj.weight", _q_lora),
        ("self_attention.linear_q_proj.weight", "self_attn.q_proj.weight", _no_q_lora),
        ("self_attention.linear_kv_down_proj.weight", "self_attn.kv_a_proj_with_mqa.weight", _ALWAYS),
        ("self_attention.kv_layernorm.weight", "self_attn.kv_a_layernorm.weight", _ALWAYS),
        ("self_attention.linear_kv_up_proj.weight", "self_attn.kv_b_proj.weight", _ALWAYS),
        ("self_attention.linear_proj.weight", "self_attn.o_proj.weight", _ALWAYS),
        ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight", _ALWAYS)))
    mlp = ((GatedMLP(prefix + "mlp.linear_fc1.weight", _HF + "mlp.gate_proj.weight", _HF + "mlp.up_proj.weight"),
            _ALWAYS), (Rename(prefix + "mlp.linear_fc2.weight", _HF + "mlp.down_proj.weight"), _ALWAYS))
    expert, shared = _HF + "mlp.experts.{expert}.", _HF + "mlp.shared_experts."
    moe = ((Rename(prefix + "mlp.router.weight", _HF + "mlp.gate.weight"), _ALWAYS),
           (Rename(prefix + "mlp.router.expert_bias", _HF + "mlp.gate.e_score_correction_bias"), _ALWAYS),
           (GatedMLP(prefix + "mlp.experts.experts.linear_fc1.weight", expert + "gate_proj.weight",
                     expert + "up_proj.weight"), _ALWAYS),
           (Rename(prefix + "mlp.experts.experts.linear_fc2.weight", expert + "down_proj.weight"), _ALWAYS),
           (GatedMLP(prefix + "mlp.shared_experts.linear_fc1.weight", shared + "gate_proj.weight",
                     shared + "up_proj.weight"), _ALWAYS),
           (Rename(prefix + "mlp.shared_experts.linear_fc2.weight", shared + "down_proj.weight"), _ALWAYS))
    return attention, mlp, moe


_DECODER, _MTP_BLOCK = _layer(""), _layer("transformer_layer.")
_MTP_OWN = tuple((Rename(m, _HF + h), _ALWAYS) for m, h in (
    ("enorm.weight", "enorm.weight"), ("hnorm.weight", "hnorm.weight"), ("eh_proj.weight", "eh_proj.weight"),
    ("final_layernorm.weight", "shared_head.norm.weight")))


@dataclasses.dataclass(frozen=True)
class DeepSeekArchitecture:
    """DeepseekV3ForCausalLM: MLA decoder layers, dense first, and its MTP layers after them."""
    name: str = DEEPSEEK_V3

    def settings(self, hf: dict) -> ModelConfig:
        return config_from_hf(hf)

    def config_json(self, model: ModelConfig) -> dict:
        return config_json(model)

    def whole(self, model: ModelConfig) -> list[Mapping]:
        """The embedding and the output head, with the copies each MTP layer keeps of them; the final norm."""
        mtp = [model.num_layers + k for k in range(model.mtp_num_layers or 0)]
        embeddings = ["model.embed_tokens.weight", *(f"model.layers.{i}.embed_tokens.weight" for i in mtp)]
        heads = ["lm_head.weight", *(f"model.layers.{i}.shared_head.head.weight" for i in mtp)]
        if model.tie_embeddings:
            return [Copies("embedding.word_embeddings.weight", (*embeddings, *heads[1:])),
                    Rename("decoder.final_layernorm.weight", "model.norm.weight")]
        return [Copies("embedding.word_embeddings.weight", tuple(embeddings)),
                Rename("decoder.final_layernorm.weight", "model.norm.weight"),
                Copies("output_layer.weight", tuple(heads))]

    def layers(self, model: ModelConfig) -> list[tuple[int, list[Mapping]]]:
        """Per megatron layer, then per MTP layer: (its HF layer, its mappings)."""
        _check_expressible(model)
        attention, mlp, moe = (pick(entries, model) for entries in _DECODER)
        out = [(i, attention + (moe if sparse else mlp)) for i, sparse in enumerate(model.moe_layer_pattern())]
        attention, mlp, moe = (pick(entries, model) for entries in _MTP_BLOCK)
        block = attention + (moe if model.moe_layer_pattern()[-1] else mlp)  # megatron's: the last layer's spec
        return out + [(model.num_layers + k, pick(_MTP_OWN, model) + block) for k in range(model.mtp_num_layers or 0)]


ARCHITECTURES = {DEEPSEEK_V3: DeepSeekArchitecture()}

"""Multi-latent attention without a query LoRA (``q_lora_rank`` None, DeepSeek-V2-Lite style) as DeepSeek defines
it: the query projection straight on the input-normed hidden state, the key/value latent normed
(``kv_a_layernorm``) before its up projection (transformers' ``DeepseekV3Attention`` with ``q_lora_rank=None``:
``q_proj``; ``kv_a_proj_with_mqa`` -> ``kv_a_layernorm`` -> ``kv_b_proj``).

megatron-core 0.16 to 0.18 build that from the local spec (its query norm is built only over a query LoRA's
latent). 0.19 resolves MLA's norms through ``QKNormConfigResolver``, which refuses the local spec's query norm
without a query LoRA (it would "not be used"), and otherwise, with ``qk_layernorm``, forces ``linear_q_proj`` to
the backend's fused norm + linear: a second, trainable norm over the already-normed hidden state that DeepSeek
has not (Megatron-Bridge issue 5261, "DeepSeek MLA with q_lora_rank=null builds a trainable Q-norm the HF
architecture does not define", worked around there with a subclass too). ``MLASelfAttention`` resolves its
norms in the overridable ``_resolve_qk_norm_config``; this subclass answers exactly the case megatron refuses,
a spec giving a query norm with no query latent for it, the way 0.16 - 0.18 and DeepSeek build it, and leaves
every other case (the TE spec's fused projections included) to megatron.
"""

from __future__ import annotations

from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.multi_latent_attention import MLASelfAttention


def norms_a_missing_query_latent(config, submodules) -> bool:
    """Whether ``submodules`` give MLA without a query LoRA a query norm (megatron's local spec with
    ``qk_layernorm``): there is no query latent to norm, and DeepSeek norms nothing there."""
    return (config.q_lora_rank is None and submodules.q_layernorm not in (None, IdentityOp)
            and config.experimental_attention_variant != "dsa")


class DeepSeekMLASelfAttention(MLASelfAttention):
    """``MLASelfAttention`` whose query projection without a query LoRA is the spec's plain ``linear_q_proj``
    (no norm), beside the spec's own key/value latent norm and its unfused up projection."""

    def _resolve_qk_norm_config(self, submodules):
        if not norms_a_missing_query_latent(self.config, submodules):
            return super()._resolve_qk_norm_config(submodules)
        return dict(linear_q_proj=submodules.linear_q_proj, linear_q_up_proj=IdentityOp,
                    linear_kv_up_proj=submodules.linear_kv_up_proj, q_layernorm=IdentityOp,
                    kv_layernorm=submodules.kv_layernorm)


def deepseek_queries_in(get_local_submodules):
    """``get_gpt_layer_local_submodules``: its MLA layers are ``DeepSeekMLASelfAttention`` (identical to
    megatron's wherever megatron builds the spec at all)."""

    def local_submodules(*args, **kwargs):
        submodules = get_local_submodules(*args, **kwargs)
        attention = submodules.self_attention
        if getattr(attention, "module", None) is MLASelfAttention:
            attention.module = DeepSeekMLASelfAttention
        return submodules

    return local_submodules

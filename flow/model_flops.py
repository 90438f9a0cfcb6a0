"""The model-FLOPs count behind a TFLOP/s figure (the benches' and the tests' of the FLOPs of a named model).

Model FLOPs follow the PaLM appendix B convention: per token, 6 x the matmul parameters (forward 2, backward 4)
plus 6 x 2 x layers x seq x heads x head size for the attention score and value products (PaLM's 12LHQT).
Heads x head size, the attention width, is the hidden size unless the head size is set apart (Qwen3's 128): then
the score and value products and the output projection's input are that width, not the hidden size.
Recomputation is not counted (it is hardware work, not model work), so TFLOP/s from it is model-FLOPs
utilisation's numerator. A MoE layer's matmul parameters are those a token passes through: its top-k routed
experts and the shared expert (the router's small GEMM left out, as Megatron-LM's count leaves it).
"""

from __future__ import annotations

from models.config import FULL_ATTENTION, ModelConfig


def model_flops_per_token(model: ModelConfig, seq_length: int) -> float:
    """Training FLOPs per token of ``model`` at ``seq_length``: 6 x the matmul parameters a token passes
    through, plus each attention layer's scores and weighted sum over the whole sequence (12 x seq x width,
    s x s not halved for causality), plus each Gated DeltaNet layer's state work (per value head the
    decay-and-correct update, the error and the readout, 2 dk dv FLOPs each, x 3 for training). Multi-latent
    attention: its projections, and scores over the query/key head, the weighted sum over the value head; each
    MTP layer: one more layer like the last, its 2h -> h projection and its own logits (as Megatron-LM counts
    them)."""
    h, width = model.hidden_size, model.num_attention_heads * model.head_dim
    attention, scores = model.qkv_rows * h + width * h, 2 * width
    if model.multi_latent_attention:
        attention = model.latent_attention_parameters()
        scores = model.num_attention_heads * (model.qk_head_dim + model.qk_pos_emb_head_dim + model.v_head_dim)
    gdn_proj = model.gated_delta_net_parameters() - model.linear_value_head_dim  # no norm weight
    gdn_state = 3 * 3 * 2 * model.linear_key_head_dim * model.linear_value_head_dim * model.linear_num_value_heads

    def mlp(ffn: int | None) -> int:
        return (3 if model.activation == "swiglu" else 2) * h * ffn if ffn else 0

    moe = model.moe_router_topk * mlp(model.expert_ffn_hidden_size) + mlp(model.moe_shared_expert_intermediate_size)
    mlps = sum(moe if is_moe else mlp(model.ffn_hidden_size) for is_moe in model.moe_layer_pattern())
    full = sum(mixer == FULL_ATTENTION for mixer in model.mixers())
    linear = model.num_layers - full
    matmul_params = full * attention + linear * gdn_proj + mlps + model.vocab_size * h  # with the output layer
    mtp = model.mtp_num_layers or 0
    last_mlp = moe if model.moe_layer_pattern()[-1] else mlp(model.ffn_hidden_size)
    matmul_params += mtp * (attention + last_mlp + 2 * h * h + model.vocab_size * h)
    return 6 * matmul_params + 6 * (full + mtp) * seq_length * scores + linear * gdn_state

"""Tiny DeepSeek-V3 checkpoints built by transformers from configs (random weights, no hub), with the MTP layer
transformers' model does not build written beside them as DeepSeek publishes it (``model.layers.<N>.*``), and
an independent torch reference of that MTP layer's output."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.hf_models import TOKENIZER_CONFIG

_YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1}
# odd sizes throughout (hidden 48, heads of 10 + 8 query/key and 12 value dimensions); with a query LoRA, one dense
# layer, YaRN over 16 original positions (the tests run 24), mscale != mscale_all_dim, 8 experts in 4 groups of
# which 2 are kept (top 4), one shared expert and an MTP layer; two dense layers, plain RoPE, plain top-2 of 6
# experts, two shared experts, tied embeddings; without a query LoRA (DeepSeek-V2-Lite's one q_proj), two layers,
# the second of 4 experts (top 2).
DEEPSEEK = {
    "dsv3-qlora-yarn-mtp": dict(
        num_attention_heads=4, q_lora_rank=24, n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=4,
        first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5, num_mtp_layers=1,
        max_position_embeddings=64, rope_scaling={**_YARN, "mscale": 0.8, "mscale_all_dim": 1.0},
        tie_word_embeddings=False),
    "dsv3-dense2-tied": dict(
        num_attention_heads=6, q_lora_rank=20, n_routed_experts=6, n_group=1, topk_group=1, num_experts_per_tok=2,
        first_k_dense_replace=2, n_shared_experts=2, routed_scaling_factor=1.5, num_mtp_layers=0,
        max_position_embeddings=64, tie_word_embeddings=True),
    "dsv2lite-no-qlora": dict(
        num_attention_heads=4, q_lora_rank=None, n_routed_experts=4, n_group=1, topk_group=1, num_experts_per_tok=2,
        first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=1.0, num_mtp_layers=0,
        max_position_embeddings=64, tie_word_embeddings=False, num_hidden_layers=2),
}
_SIZES = dict(vocab_size=96, hidden_size=48, intermediate_size=80, moe_intermediate_size=24, num_hidden_layers=4,
              kv_lora_rank=16, qk_nope_head_dim=10, qk_rope_head_dim=8, v_head_dim=12, rms_norm_eps=1e-6)


def config_of(name: str):
    import transformers

    overrides = DEEPSEEK[name]
    return transformers.DeepseekV3Config(**{**_SIZES, **overrides},
                                         num_key_value_heads=overrides["num_attention_heads"])


def _perturb(module, generator) -> None:
    """HF initialises norms to 1, the expert bias to 0 and the router near 0: make every tensor count (the router
    spread wide enough that a bias of 0.1 reorders some experts but no near-ties decide)."""
    with torch.no_grad():
        for name, p in [*module.named_parameters(), *module.named_buffers()]:
            if "norm" in name or name.endswith("e_score_correction_bias"):
                p.add_(torch.randn(p.shape, generator=generator) * 0.1)
            elif name.endswith("gate.weight"):
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3)


def _mtp_tensors(model, config, generator) -> dict:
    """MTP layer k as DeepSeek-V3's checkpoint stores it: a decoder layer (its experts one tensor per expert),
    the two input norms, the projection, the shared head's norm and copies of the embedding and output head."""
    import transformers.models.deepseek_v3.modeling_deepseek_v3 as ds

    out = {}
    for k in range(config.num_mtp_layers):
        index = config.num_hidden_layers + k
        layer = ds.DeepseekV3DecoderLayer(config, index)
        extra = {"enorm": ds.DeepseekV3RMSNorm(config.hidden_size), "hnorm": ds.DeepseekV3RMSNorm(config.hidden_size),
                 "eh_proj": torch.nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False),
                 "shared_head.norm": ds.DeepseekV3RMSNorm(config.hidden_size)}
        with torch.no_grad():
            for p in layer.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
            extra["eh_proj"].weight.copy_(torch.randn(extra["eh_proj"].weight.shape, generator=generator) * 0.1)
        _perturb(layer, generator)
        for module in extra.values():
            _perturb(module, generator)
        state = {**_per_expert(layer.state_dict()),
                 **{f"{n}.weight": m.weight for n, m in extra.items()},
                 "embed_tokens.weight": model.model.embed_tokens.weight,
                 "shared_head.head.weight": model.lm_head.weight}
        out.update({f"model.layers.{index}.{name}": t.detach().clone().contiguous() for name, t in state.items()})
    return out


def _per_expert(state: dict) -> dict:
    """transformers holds a layer's experts as one gate_up and one down tensor; checkpoints hold each expert's."""
    out = {}
    for name, tensor in state.items():
        if name.endswith("experts.gate_up_proj"):
            stem = name.removesuffix("gate_up_proj")
            for e, fused in enumerate(tensor):
                gate, up = fused.chunk(2)
                out[f"{stem}{e}.gate_proj.weight"], out[f"{stem}{e}.up_proj.weight"] = gate, up
        elif name.endswith("experts.down_proj"):
            stem = name.removesuffix("down_proj")
            out.update({f"{stem}{e}.down_proj.weight": t for e, t in enumerate(tensor)})
        else:
            out[name] = tensor
    return out


def save_tiny_deepseek(name: str, directory: Path, seed: int = 0, dtype=torch.float32) -> Path:
    """transformers' DeepseekV3ForCausalLM of DEEPSEEK[name], saved by save_pretrained, with its MTP layers added
    to the safetensors (and the index) as the published checkpoint holds them."""
    import transformers
    from safetensors.torch import load_file, save_file

    config = config_of(name)
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    _perturb(model, generator)
    mtp = _mtp_tensors(model, config, generator)
    model.to(dtype).save_pretrained(directory)
    if mtp:
        path = directory / "model.safetensors"
        save_file({**load_file(path), **{n: t.to(dtype) for n, t in mtp.items()}}, path, metadata={"format": "pt"})
    (directory / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG))
    return directory


def mtp_reference_logits(hf_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3's MTP layer 0 in plain torch over transformers' modules, from the checkpoint's own tensors:
    position i combines the main model's output hidden state h_i (after its final norm) with the embedding of
    token i + 1: eh_proj([enorm(emb), hnorm(h)]) (the order DeepSeek-V3's checkpoint is served with), one causal
    decoder block over positions 0..s-2 with the model's RoPE, shared_head.norm and the shared output head.
    Returns [batch, seq - 1, vocab]."""
    import transformers
    import transformers.models.deepseek_v3.modeling_deepseek_v3 as ds
    from safetensors.torch import load_file

    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    config = hf.config
    index = config.num_hidden_layers
    prefix = f"model.layers.{index}."
    state = {n[len(prefix):]: t.float() for n, t in load_file(Path(hf_dir) / "model.safetensors").items()
             if n.startswith(prefix)}
    block = ds.DeepseekV3DecoderLayer(config, index).eval()
    fused = {}
    experts = range(config.n_routed_experts)
    fused["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([state[f"mlp.experts.{e}.gate_proj.weight"],
                                                                 state[f"mlp.experts.{e}.up_proj.weight"]])
                                                      for e in experts])
    fused["mlp.experts.down_proj"] = torch.stack([state[f"mlp.experts.{e}.down_proj.weight"] for e in experts])
    block.load_state_dict({**{n: t for n, t in state.items() if n in block.state_dict()}, **fused}, strict=True)

    def norm(name, x):  # RMSNorm, in float32
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps) * state[name + ".weight"]

    with torch.no_grad():
        hidden = hf.model(input_ids=tokens).last_hidden_state[:, :-1]
        embedded = torch.nn.functional.embedding(tokens[:, 1:], state["embed_tokens.weight"])
        x = torch.cat([norm("enorm", embedded), norm("hnorm", hidden)], dim=-1) @ state["eh_proj.weight"].T
        length = x.shape[1]
        positions = torch.arange(length).unsqueeze(0).expand(tokens.shape[0], -1)
        mask = torch.full((length, length), float("-inf")).triu(1)[None, None].expand(tokens.shape[0], 1, -1, -1)
        x = block(x, attention_mask=mask, position_ids=positions,
                  position_embeddings=hf.model.rotary_emb(x, positions))
        x = x[0] if isinstance(x, tuple) else x
        return norm("shared_head.norm", x) @ state["shared_head.head.weight"].T

"""Rank function: megatron's selective recompute of each module on a tiny GPT built by models/provider.py (the
project's own flow's builder), or for ``mla_up_proj`` on a tiny multi-latent attention GPT from megatron's local
spec, against the same training without recompute; and the activation bytes the forward leaves for backward,
counted by torch's saved-tensor hooks."""

from __future__ import annotations

import adapter  # noqa: F401 - before megatron, as a user script does
import torch

import models
from models.provider import build_model, transformer_config
from tests.kernel_reference import one_rank_model_parallel

# dense and MoE layers alternating, so "mlp" and the MoE modules each have layers to act on
MODEL = models.get("gpt-tiny-moe-shared").replace(moe_layer_freq=(0, 1, 0, 1))
BATCH = 2


class SavedActivations:
    """Bytes of the tensors autograd holds for backward when the forward ends: each storage once, and a
    storage megatron released after saving (``discard_output_and_register_recompute``) counts as its size then,
    zero. Parameters are left out: they are held anyway."""

    def __init__(self, parameters):
        self._parameters = {p.untyped_storage().data_ptr() for p in parameters}
        self._saved = []

    def pack(self, tensor):
        self._saved.append(tensor)
        return tensor

    def nbytes(self) -> int:
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in self._saved}
        return sum(size for ptr, size in storages.items() if ptr not in self._parameters)


def _batch(step: int):
    generator = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, MODEL.vocab_size, (BATCH, MODEL.seq_length + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:], torch.arange(MODEL.seq_length).expand(BATCH, -1)


def _mla_model(**recompute):
    """Two dense layers of DeepSeek-V3's multi-latent attention (q/kv low-rank, YaRN RoPE with megatron's
    fused entry points, as Megatron-LM's default) from megatron's local spec, the same vocabulary and
    sequence as MODEL: ``mla_up_proj`` needs MLA."""
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    config = MLATransformerConfig(
        num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, multi_latent_attention=True,
        q_lora_rank=32, kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16, rope_type="yarn",
        rotary_scaling_factor=40.0, mscale=1.0, mscale_all_dim=1.0, apply_rope_fusion=True, normalization="RMSNorm",
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, init_method_std=0.02, use_cpu_initialization=True, **recompute)
    spec = get_gpt_layer_local_spec(multi_latent_attention=True, normalization="RMSNorm")
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=MODEL.vocab_size,
                    max_sequence_length=MODEL.seq_length, position_embedding_type="rope")


def _train(modules: list[str] | None, steps: int, mla: bool = False) -> tuple[list[float], int, list]:
    recompute = dict(recompute_granularity="selective", recompute_modules=modules) if modules else {}
    with one_rank_model_parallel():
        torch.manual_seed(0)
        if mla:
            model = _mla_model(**recompute)
        else:
            model = build_model(MODEL, transformer_config(MODEL, moe_grouped_gemm=True, **recompute))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        losses, saved, grads = [], None, None
        for step in range(steps):
            tokens, labels, positions = _batch(step)
            counter = SavedActivations(model.parameters())
            with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda tensor: tensor):
                loss = model(tokens, positions, attention_mask=None, labels=labels).mean()
            saved = counter.nbytes() if saved is None else saved
            del counter
            optimizer.zero_grad()
            loss.backward()
            grads = [p.grad.clone() for p in model.parameters()] if grads is None else grads
            optimizer.step()
            losses.append(loss.item())
    return losses, saved, grads


def curves(module_sets: list[list[str] | None], steps: int = 3, mla: bool = False) -> list[tuple]:
    """(losses, bytes saved for backward at the first step's end of forward, the first step's parameter
    gradients) for each set of modules, on MODEL or (``mla``) on the multi-latent attention GPT."""
    return [_train(modules, steps, mla) for modules in module_sets]

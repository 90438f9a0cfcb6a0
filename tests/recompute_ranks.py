"""Rank function: megatron's selective recompute of each module on a tiny GPT built by models/provider.py (the
project's own flow's builder), against the same training without recompute; and the activation bytes the
forward leaves for backward, counted by torch's saved-tensor hooks."""

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


def _train(modules: list[str] | None, steps: int) -> tuple[list[float], int]:
    recompute = dict(recompute_granularity="selective", recompute_modules=modules) if modules else {}
    with one_rank_model_parallel():
        torch.manual_seed(0)
        config = transformer_config(MODEL, moe_grouped_gemm=True, **recompute)
        model = build_model(MODEL, config)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        losses, saved = [], None
        for step in range(steps):
            tokens, labels, positions = _batch(step)
            counter = SavedActivations(model.parameters())
            with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda tensor: tensor):
                loss = model(tokens, positions, attention_mask=None, labels=labels).mean()
            saved = counter.nbytes() if saved is None else saved
            del counter
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return losses, saved


def curves(module_sets: list[list[str] | None], steps: int = 3) -> list[tuple[list[float], int]]:
    """(losses, bytes saved for backward at the first step's end of forward) for each set of modules."""
    return [_train(modules, steps) for modules in module_sets]

"""Rank functions for the conversion tests: megatron models at some TP/PP loading converted checkpoints,
and megatron saving a checkpoint of its own as training does."""

from __future__ import annotations

from pathlib import Path

import adapter  # noqa: F401 - before megatron
import torch
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from adapter.checkpoint_dir import TRACKER
from models.torch_dist_io import load_model_weights
from models.provider import make_model_provider
from models.verify import hf_logits, megatron_logits


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(7))


def _model(model, tp: int, pp: int, seed: int = 0, initialise: bool = False, ep: int = 1, **config) -> list:
    if not torch.distributed.is_initialized():
        adapter.init_distributed()
    parallel_state.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    provider = make_model_provider(model, perform_initialization=initialise, **config)
    chunk = provider(pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage())
    return [chunk.eval()]


def _finish() -> None:
    torch.distributed.barrier()
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def megatron_logits_from(model, load_dir: str, tp: int, pp: int):
    """This rank's full logits after loading ``load_dir`` at TP ``tp`` x PP ``pp`` (None off the last
    stage)."""
    chunks = _model(model, tp, pp)
    load_model_weights(chunks, load_dir)
    logits = megatron_logits(chunks, _tokens(model.vocab_size), model)
    _finish()
    return logits


def megatron_logits_at_layouts(model, load_dir: str, layouts: list[tuple[int, int, int]]) -> list:
    """This rank's full logits (None off the last stage) after loading ``load_dir`` at each (TP, PP, EP) of
    ``layouts`` in turn, on one set of ranks: megatron's groups are rebuilt between layouts."""
    out = []
    for tp, pp, ep in layouts:
        chunks = _model(model, tp, pp, ep=ep)
        load_model_weights(chunks, load_dir)
        out.append(megatron_logits(chunks, _tokens(model.vocab_size), model))
        parallel_state.destroy_model_parallel()
    _finish()
    return out


def hf_logits_of(hf_dir: str, vocab: int) -> torch.Tensor:
    return hf_logits(hf_dir, _tokens(vocab))


def save_like_training(model, save_dir: str, tp: int, pp: int, iteration: int = 100, ep: int = 1,
                       config: dict | None = None):
    """Random weights at TP x PP (x EP) saved by megatron's dist_checkpointing (as a training run saves
    them; ``config``: TransformerConfig settings such as the flow's grouped experts); returns this rank's
    logits."""
    chunks = _model(model, tp, pp, seed=3, initialise=True, ep=ep, **(config or {}))
    with torch.no_grad():  # norms start at 1: perturb them so a misplaced norm shows
        for name, p in chunks[0].named_parameters():
            if "norm" in name:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    path = Path(save_dir) / f"iter_{iteration:07d}"
    if torch.distributed.get_rank() == 0:
        path.mkdir(parents=True)
    torch.distributed.barrier()
    dist_checkpointing.save({"model": chunks[0].sharded_state_dict()}, str(path))
    if torch.distributed.get_rank() == 0:
        (Path(save_dir) / TRACKER).write_text(str(iteration))
    logits = megatron_logits(chunks, _tokens(model.vocab_size), model)
    _finish()
    return logits

"""Rank function: a torch_dist checkpoint of the tiny GPT on megatron's local spec (what both
``--transformer-impl`` spellings build without Transformer Engine), its keys, and a load into another model."""

from __future__ import annotations

import tempfile

import adapter  # noqa: F401 - before megatron, as a user script does
import torch
from megatron.core import dist_checkpointing

import models
from models.provider import build_model, transformer_config
from tests.kernel_reference import one_rank_model_parallel

MODEL = models.get("gpt-tiny")


def _model(seed: int):
    torch.manual_seed(seed)
    return build_model(MODEL, transformer_config(MODEL))


def save_and_load_keys() -> dict:
    """The saved checkpoint's keys, and whether a model of another seed gets the saved weights back."""
    with one_rank_model_parallel(), tempfile.TemporaryDirectory() as directory:
        saved = _model(0)
        dist_checkpointing.save(saved.sharded_state_dict(), directory)
        keys = sorted(dist_checkpointing.load_tensors_metadata(directory))
        fresh = _model(1)
        fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), directory))
        same = all(torch.equal(a, b) for a, b in zip(saved.state_dict().values(), fresh.state_dict().values())
                   if isinstance(a, torch.Tensor))
    return {"keys": keys, "loaded_equal": same}

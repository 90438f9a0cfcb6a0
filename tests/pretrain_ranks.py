"""Rank functions for the pretrain-flow tests: scripts/pretrain_gpt.py's providers through ``pretrain``."""

from __future__ import annotations

import os

import adapter  # noqa: F401 - before megatron
import torch
from megatron.core.enums import ModelType

from adapter.training import checkpointing
from adapter.training.pretrain import pretrain
from scripts.pretrain_gpt import forward_step, model_provider, train_valid_test_datasets_provider


def run_pretrain(argv: list[str]) -> dict:
    history = pretrain(train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder,
                       forward_step, argv=argv)
    torch.distributed.destroy_process_group()
    return history


def run_pretrain_killed_in_save(argv: list[str], iteration: int) -> dict:
    """As run_pretrain, but rank 0 dies (as if killed) once every rank has written the checkpoint of
    ``iteration`` and before it is published."""
    save = checkpointing.dist_checkpointing.save

    def save_then_die(state, directory, *args, **kwargs):
        save(state, directory, *args, **kwargs)
        if f"iter_{iteration:07d}" in directory and torch.distributed.get_rank() == 0:
            os._exit(9)

    checkpointing.dist_checkpointing.save = save_then_die
    return run_pretrain(argv)

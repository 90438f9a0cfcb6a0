"""The GPT step megatron.training's ``pretrain`` runs: dataset provider, forward step and loss, written from
megatron-core's interfaces (GPTDataset through BlendedMegatronDatasetBuilder, ``get_batch_on_this_tp_rank`` /
``get_batch_on_this_cp_rank``, the rerun state machine) for the arguments megatron.training parsed.

Megatron-LM's own ``pretrain_gpt.py`` does the same with SFT, FIM, packed sequences, ModelOpt and distillation
on top; those stay Megatron-LM's (its script runs unchanged through ``adapter.run``). This module is what the
project's entry point needs and no more, and draws the same numbers for the same flags: the same datasets,
batches and loss reduction, so the two entry points' losses can be compared to the bit.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.core.utils import get_attr_wrapped_model
from megatron.training import get_args, get_tokenizer
from megatron.training.utils import get_blend_and_blend_per_split, is_first_or_last_pipeline_stage

from adapter import device
from flow import releases

# Megatron-LM's pretrain_gpt.py's: a loss this many times the recent ones is a spike to re-run
SPIKY_LOSS_FACTOR = 10
_BATCH = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")
# GPTDatasetConfig fields whose megatron.training argument has another name; the rest share theirs
_RENAMED = {"random_seed": "seed", "sequence_length": "seq_length", "path_to_cache": "data_cache_path",
            "create_attention_mask": "create_attention_mask_in_dataloader",
            "fast_cache_load": "dataloader_fast_cache_load", "defer_npy_index_mmap": "dataloader_defer_npy_index_mmap",
            "inter_document_masking": "dataloader_inter_document_masking"}


def dataset_config(args) -> GPTDatasetConfig:
    """GPTDatasetConfig from megatron.training's arguments: every field the arguments name, by name."""
    values = {field.name: getattr(args, _RENAMED.get(field.name, field.name))
              for field in dataclasses.fields(GPTDatasetConfig)
              if field.init and hasattr(args, _RENAMED.get(field.name, field.name))}
    values["blend"], values["blend_per_split"] = get_blend_and_blend_per_split(args)
    values["sequence_parallel_size"] = args.tensor_model_parallel_size * args.sequence_parallel
    values["tokenizer"] = get_tokenizer()
    values.pop("mock", None)  # derived from the blends
    return GPTDatasetConfig(**values)


def is_dataset_built_on_rank(vp_stage=None) -> bool:
    """Tensor-parallel rank 0 of the stages that take data reads it; the others get it broadcast."""
    return parallel_state.get_tensor_model_parallel_rank() == 0 and is_first_or_last_pipeline_stage(vp_stage)


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """(train, valid, test) GPT datasets of at least the given sizes: mock tokens with ``--mock-data``."""
    args = get_args()
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    built_here = functools.partial(is_dataset_built_on_rank, vp_stage=vp_stage)
    return BlendedMegatronDatasetBuilder(dataset_type, train_val_test_num_samples, built_here,
                                        dataset_config(args)).build()


train_valid_test_datasets_provider.is_distributed = True


def get_batch(data_iterator, vp_stage=None):
    """(tokens, labels, loss_mask, attention_mask, position_ids) of the next micro-batch on every
    tensor-parallel rank (rank 0 reads, megatron broadcasts), this context-parallel rank's part of it."""
    if not is_first_or_last_pipeline_stage(vp_stage):
        return (None,) * len(_BATCH)
    batch = releases.batch_on_this_tp_rank(data_iterator, get_args(), _read)
    batch = releases.batch_on_this_cp_rank(batch)
    return tuple(batch.get(key) for key in _BATCH)


def _read(data_iterator) -> dict:
    """The next micro-batch, its tensors on this rank's device."""
    here = device.torch_device()
    return {key: value.to(here, non_blocking=True) if torch.is_tensor(value) else value
            for key, value in next(data_iterator).items()}


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """(sum of unmasked token losses, their count, {"lm loss": [sum, count]}): megatron's schedule divides by
    the tokens of all micro-batches and data-parallel ranks. The sum goes to megatron's rerun state machine as
    Megatron-LM's pretrain_gpt.py hands it over: a NaN / Inf under ``--check-for-nan-in-loss-and-grad`` (fatal),
    a loss ``SPIKY_LOSS_FACTOR`` times the recent ones under ``--check-for-spiky-loss`` (re-run, not fatal)."""
    mask = loss_mask.view(-1).float()
    loss = torch.sum(output_tensor.view(-1).float() * mask)
    args, machine = get_args(), get_rerun_state_machine()
    if args.check_for_nan_in_loss_and_grad:
        for reject, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            machine.validate_result(result=loss, rejection_func=reject, tolerance=0.0, fatal=True,
                                    message=f"found {what} in local forward loss calculation")
    if args.check_for_spiky_loss:
        machine.validate_result(result=loss, rejection_func=functools.partial(
            machine.is_unexpectedly_large, threshold=SPIKY_LOSS_FACTOR, context="loss"),
            message="Spiky loss", tolerance=0.0, fatal=False)
    tokens = mask.sum().clone().detach().to(torch.int)
    return loss, tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), tokens.view(1)])}


def forward_step(data_iterator, model):
    """One micro-batch through ``model``: its per-token losses and the loss function to reduce them."""
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(
        data_iterator, get_attr_wrapped_model(model, "vp_stage"))
    output = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output, functools.partial(loss_func, loss_mask)

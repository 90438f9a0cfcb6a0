"""The GPT / Qwen training step handed to ``pretrain``: the model provider, the loss function and the
forward step, as Megatron-LM's ``pretrain_gpt.py`` defines them.

A library module rather than part of ``scripts/pretrain_gpt.py``: scripts stay entry points (run as files,
by torchrun, never imported), and the benchmarks and tests that drive ``pretrain`` in-process import the
step from here, so they train exactly what the script trains without importing an entry point. The
dataset provider is ``adapter.training.data.train_valid_test_datasets_provider``.
"""

from __future__ import annotations

import functools

import torch
from megatron.core.utils import get_attr_wrapped_model

from adapter.training import nonfinite
from adapter.training.data import get_batch
from adapter.training.global_vars import get_args
from adapter.training.pretrain import transformer_config_overrides
from models.provider import make_model_provider


def model_provider(pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None):
    args = get_args()
    provider = make_model_provider(args.model_config, **transformer_config_overrides(args))
    return provider(pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Per-token losses -> (sum over unmasked tokens, their count, {"lm loss": [sum, count]}), the form
    megatron's schedule averages over tokens across micro-batches and data-parallel ranks. The sum is checked
    as Megatron-LM checks it (NaN, Inf, spiky: ``nonfinite.check_loss``)."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    total = torch.sum(losses * mask)
    nonfinite.check_loss(total)
    count = mask.sum().to(torch.int)
    return total, count, {"lm loss": torch.stack([total.detach().clone(), mask.sum().detach()])}


def forward_step(data_iterator, model):
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(
        data_iterator, vp_stage=get_attr_wrapped_model(model, "vp_stage"))
    # megatron's MTP loss (which the model adds) masks as the language-model loss does
    mtp = {"loss_mask": loss_mask} if get_args().model_config.mtp_num_layers else {}
    output = model(tokens, position_ids, attention_mask, labels=labels, **mtp)
    return output, functools.partial(loss_func, loss_mask)

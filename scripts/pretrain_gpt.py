"""Pretrain a GPT / Qwen model with megatron-core through the device adapter, as Megatron-LM's
``pretrain_gpt.py`` does: the model provider, the dataset provider and the forward step, handed to
``pretrain``. Megatron-LM's arguments, plus ``--model NAME`` for a named config:

    torchrun --nproc_per_node 4 scripts/pretrain_gpt.py --model qwen2.5-tiny \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --micro-batch-size 2 \\
        --global-batch-size 8 --train-iters 100 --lr 1e-3 --mock-data

The same command runs on CPUs (gloo), NVIDIA GPUs (NCCL) and Ascend NPUs (HCCL); the adapter picks.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runnable from a checkout

import adapter  # noqa: E402,F401  - before megatron
from adapter.training import compile_probe  # noqa: E402

compile_probe.probe_in_background()  # torch.compile's CPU probe beside the imports below, not in iteration 1

import torch  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.utils import get_attr_wrapped_model  # noqa: E402

from adapter.training.arguments import ArgumentError  # noqa: E402
from adapter.training.data import get_batch, train_valid_test_datasets_provider  # noqa: E402
from adapter.training.global_vars import get_args  # noqa: E402
from adapter.training.pretrain import pretrain, transformer_config_overrides  # noqa: E402
from adapter.training.shared_outcome import StepFailed  # noqa: E402
from models.provider import make_model_provider  # noqa: E402


def model_provider(pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None):
    args = get_args()
    provider = make_model_provider(args.model_config, **transformer_config_overrides(args))
    return provider(pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Per-token losses -> (sum over unmasked tokens, their count, {"lm loss": [sum, count]}), the form
    megatron's schedule averages over tokens across micro-batches and data-parallel ranks."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    total = torch.sum(losses * mask)
    count = mask.sum().to(torch.int)
    return total, count, {"lm loss": torch.stack([total.detach().clone(), mask.sum().detach()])}


def forward_step(data_iterator, model):
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(
        data_iterator, vp_stage=get_attr_wrapped_model(model, "vp_stage"))
    output = model(tokens, position_ids, attention_mask, labels=labels)
    return output, functools.partial(loss_func, loss_mask)


def main(argv=None) -> int:
    try:
        pretrain(train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder, forward_step,
                 argv=argv)
    except ArgumentError as exc:  # found once ranks are running (e.g. datasets that cannot be built)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except StepFailed as exc:  # a save that failed: every rank stops with the one error
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

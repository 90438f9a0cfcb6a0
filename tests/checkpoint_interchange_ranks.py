"""Rank functions for tests/test_checkpoint_interchange.py: the flow's checkpoint read by Megatron-LM's own
``load_checkpoint`` (megatron.training, which megatron-core's wheel ships from 0.17), with no Megatron-LM
checkout."""

from __future__ import annotations

import sys
from unittest import mock

import adapter  # noqa: F401 - before megatron
import torch
from megatron.core import tensor_parallel

from adapter.training import checkpointing
from adapter.training.global_vars import get_args
from tests.pretrain_ranks import run_pretrain_keeping_setup


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a Megatron-FSDP DTensor; a plain tensor as it is."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _members(optimizer) -> list:
    """megatron's optimizers in ``optimizer``: a chain's members (DDP), or itself (Megatron-FSDP)."""
    return getattr(optimizer, "chained_optimizers", [optimizer])


def _model_and_optimizer_state(model: list, optimizer, scheduler) -> dict:
    """Copies of what a checkpoint carries: the parameters, Adam's moments and step, the scheduler's step."""
    params = [_local(p).detach().clone() for chunk in model for p in chunk.parameters()]
    moments = [{k: _local(v).clone() if torch.is_tensor(v) else v for k, v in opt.optimizer.state[p].items()}
               for opt in _members(optimizer) for group in opt.optimizer.param_groups
               for p in group["params"]]
    return {"params": params, "moments": moments, "steps": scheduler.num_steps}


def _scramble(model: list, optimizer, scheduler) -> None:
    """Everything a load must put back, made wrong: parameters and moments zero, the schedule at its start,
    the random streams moved on."""
    with torch.no_grad():
        for chunk in model:
            for p in chunk.parameters():
                p.zero_()
        for opt in _members(optimizer):
            for state in opt.optimizer.state.values():
                for value in state.values():
                    if torch.is_tensor(value):
                        value.zero_()
    scheduler.num_steps = 0
    torch.manual_seed(99)
    tensor_parallel.model_parallel_cuda_manual_seed(99)


def _random_state() -> list:
    tracker = tensor_parallel.get_cuda_rng_tracker().get_states()
    return [torch.get_rng_state(), *(tracker[name] for name in sorted(tracker))]


def _megatron_lm_args(argv: list[str], load: str):
    """Megatron-LM's arguments for ``argv`` (the flow's flags, which are Megatron-LM's), as its
    ``initialize_megatron`` parses and checks them, set as its global arguments."""
    from megatron.training import arguments, global_vars

    with mock.patch.object(sys, "argv", ["pretrain_gpt.py", *argv, "--load", load]):
        args = arguments.validate_args(arguments.parse_args())
    global_vars.set_args(args)
    return args


def megatron_lm_loads_the_flow_checkpoint(argv: list[str], save: str) -> dict:
    """Train and save with the flow; then its checkpoint is read into the scrambled model, optimizer and
    scheduler by the flow's ``load_checkpoint`` and by Megatron-LM's: what each gives back, against the live
    state at the save (the random streams against each other: the live ones moved on after the save)."""
    _, (model, optimizer, scheduler) = run_pretrain_keeping_setup(argv + ["--save", save], keep_group=True)
    live = _model_and_optimizer_state(model, optimizer, scheduler)
    flow_args = get_args()
    flow_args.load = save
    _scramble(model, optimizer, scheduler)
    flow_iteration, flow_consumed = checkpointing.load_checkpoint(flow_args, model, optimizer, scheduler)
    by_flow = {**_model_and_optimizer_state(model, optimizer, scheduler), "random": _random_state()}

    from megatron.training import checkpointing as megatron_lm

    _scramble(model, optimizer, scheduler)
    mlm_args = _megatron_lm_args(argv, save)
    iteration, _ = megatron_lm.load_checkpoint(model, optimizer, scheduler)
    by_megatron_lm = {**_model_and_optimizer_state(model, optimizer, scheduler), "random": _random_state()}
    torch.distributed.destroy_process_group()
    return {"live": live, "flow": by_flow, "megatron_lm": by_megatron_lm,
            "iterations": (flow_iteration, iteration),
            "consumed": (flow_consumed["train"], mlm_args.consumed_train_samples)}

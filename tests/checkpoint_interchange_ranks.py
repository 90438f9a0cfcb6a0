"""Rank functions for tests/test_checkpoint_interchange.py: the checkpoint scripts/pretrain_gpt.py saves read
by Megatron-LM's own ``load_checkpoint`` (megatron.training, which megatron-core's wheel ships from 0.17), with
no Megatron-LM checkout."""

from __future__ import annotations

import sys
from unittest import mock

import adapter  # noqa: F401 - before megatron
import torch
from megatron.core import tensor_parallel

from tests.flow_ranks import run_pretrain_keeping_setup


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a Megatron-FSDP DTensor; a plain tensor as it is."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _members(optimizer) -> list:
    """megatron's optimizers in ``optimizer``: a chain's members (DDP), or itself (Megatron-FSDP)."""
    return getattr(optimizer, "chained_optimizers", [optimizer])


def _optimizer_state(optimizer, scheduler) -> dict:
    """Copies of what a checkpoint carries: this rank's shard of the parameters the optimizer steps (the model's
    own Megatron-FSDP holds gathered at a save, sharded after a load), Adam's moments and step, the scheduler's
    step; and the elements of each shard (Megatron-FSDP gives some ranks none of a parameter, and Adam no state
    for it)."""
    stepped = [(opt, p) for opt in _members(optimizer) for group in opt.optimizer.param_groups
               for p in group["params"]]
    moments = [{k: _local(v).clone() if torch.is_tensor(v) else v for k, v in opt.optimizer.state[p].items()}
               for opt, p in stepped]
    params = [_local(p).detach().clone() for _, p in stepped]
    return {"params": params, "moments": moments, "steps": scheduler.num_steps,
            "shard sizes": [_local(p).numel() for _, p in stepped]}


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
    """Train and save with scripts/pretrain_gpt.py (megatron.training's ``pretrain`` through the adapter's
    patches: atomic publish, the cpu backend's writes); then Megatron-LM's ``load_checkpoint`` reads the saved
    iteration into the scrambled model, optimizer and scheduler: what it gives back, against the live state and
    random streams at the save."""
    from megatron.training import checkpointing as megatron_lm
    from megatron.training import training

    at_save, save_checkpoint = {}, training.save_checkpoint

    def noted_save(iteration, model, optimizer, scheduler, *args, **kwargs):
        at_save.update(_optimizer_state(optimizer, scheduler), random=_random_state())
        return save_checkpoint(iteration, model, optimizer, scheduler, *args, **kwargs)

    training.save_checkpoint = noted_save
    try:
        saving = argv + ["--save", save, "--save-interval", "1000"]
        _, (model, optimizer, scheduler) = run_pretrain_keeping_setup(saving, keep_group=True)
    finally:
        training.save_checkpoint = save_checkpoint
    _scramble(model, optimizer, scheduler)
    mlm_args = _megatron_lm_args(argv, save)
    iteration, _ = megatron_lm.load_checkpoint(model, optimizer, scheduler)
    by_megatron_lm = {**_optimizer_state(optimizer, scheduler), "random": _random_state()}
    torch.distributed.destroy_process_group()
    return {"live": at_save, "megatron_lm": by_megatron_lm, "iteration": iteration,
            "consumed": mlm_args.consumed_train_samples}

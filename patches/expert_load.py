"""megatron.training's run of a MoE model logs each MoE layer's expert load (adapter/expert_load.py):
megatron.training logs the router losses but not the load.

The routers of the model ``setup_model_and_optimizer`` returns are counted from the first iteration on,
under megatron's 0-based layer index (a hybrid model's too: its MoE blocks are layers of their own). At
each of megatron's log lines (``training_log``, every rank; its line printed by the last), the count summed
over all ranks is said by the last rank on a line of its own, just after megatron's, and written to
megatron's TensorBoard writer. Not through ``loss_dict``: megatron averages its entries over the line's
iterations, which would show the mean of per-iteration ratios and reduce over the ranks every iteration,
where the load is the ratio of the tokens counted over the line's iterations. As megatron's own line, the
first iteration is logged without starting the count anew. A dense model (no --num-experts) gets nothing.
"""

from __future__ import annotations

import functools
import inspect

import torch

from adapter.expert_load import ExpertLoad

_T = "megatron.training.training:"
_load: list[ExpertLoad] = []  # the run's count, once the model stands


def counted(setup_model_and_optimizer):
    """``setup_model_and_optimizer``; for a MoE model, the count over its routers from here on."""

    @functools.wraps(setup_model_and_optimizer)
    def setup(*args, **kwargs):
        from megatron.training.global_vars import get_args

        result = setup_model_and_optimizer(*args, **kwargs)
        megatron_args = get_args()
        moe = megatron_args.num_experts is not None
        _load[:] = [ExpertLoad(megatron_args.num_layers, megatron_args.num_experts, result[0])] if moe else []
        return result

    return setup


def logged(training_log):
    """``training_log``; at its log lines, the expert load's line and TensorBoard scalars."""
    signature = inspect.signature(training_log)

    @functools.wraps(training_log)
    def log(*args, **kwargs):
        from megatron.training.global_vars import get_args, get_tensorboard_writer

        result = training_log(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        iteration, first = bound.arguments["iteration"], bound.arguments["is_first_iteration"]
        megatron_args = get_args()
        if _load and (iteration % megatron_args.log_interval == 0 or first):
            load = _load[0].summary(reset=not first)
            writer = get_tensorboard_writer()
            if writer is not None:
                load.write(writer, iteration, megatron_args.moe_per_layer_logging)
            if torch.distributed.get_rank() == torch.distributed.get_world_size() - 1:
                print(f"[adapter] iteration {iteration:8d} | {load.field()} |", flush=True)
        return result

    return log


def register(registry, versions: str) -> None:
    registry.wrap(f"{_T}setup_model_and_optimizer", counted, versions=versions,
                  reason="a MoE model's routers are counted for the expert load megatron.training does not log")
    registry.wrap(f"{_T}training_log", logged, versions=versions,
                  reason="a MoE model's log says each MoE layer's expert load (max/mean tokens per expert)")

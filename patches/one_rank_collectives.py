"""Collectives over a group of one rank, answered on the calling thread on the cpu backend.

On one rank a reduce-scatter or all-gather whose output is its input, and a gather into a list of one, change
nothing but a copy. ``ProcessGroupGloo`` still runs them on its own worker thread, and there it flattens and
copies the buffers with ATen ops. An ATen op large enough to go parallel gives that worker thread an OpenMP
team of its own, which outlives the op. From then on the process has more OpenMP threads than CPUs, and
libgomp (torch's OpenMP on Linux) throttles every team's spin-wait to a few hundred spins: each parallel
region of the training thread then waits for its workers to wake from a futex. A two-thread bf16 matmul of
128 x 64 x 128 goes from 16 us to 50 us, and the tiny Qwen's step from 13 to 22 ms, for the rest of the run
(docs/PERFORMANCE.md). megatron's distributed optimizer does this once per step at one data-parallel rank
(its bucket reduce-scatter and all-gather) and once per save (the gather of its state to data-parallel rank
0). Under these patches they do not reach gloo; on more than one rank they run as written. NCCL and HCCL run
on the device and copy nothing on a host thread, so only the cpu backend gets them.
"""

import functools

import torch
from torch.overrides import TorchFunctionMode

from .gloo_collectives import _Done, runs_under

_BUFFERS = "megatron.core.distributed.param_and_grad_buffer"
_DISTRIB = "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer"
_UNCHANGED_ON_ONE_RANK = (torch.distributed.ReduceOp.SUM, torch.distributed.ReduceOp.AVG)


def _one_rank(group) -> bool:
    return torch.distributed.get_world_size(group) == 1


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.numel() == b.numel() and a.dtype == b.dtype


def skips_one_rank_in_place(collective):
    """megatron's bucket collective (``dist_reduce_scatter_func`` or ``dist_all_gather_func``: output, input)
    returning at once where it changes nothing: one rank, the output the input's own memory, a sum or mean.
    Any other call goes to ``torch.distributed``'s function of that name as it is when called, so the flow's
    hang tracker, which wraps those functions while it runs, still sees it."""
    name = collective.__name__

    @functools.wraps(collective)
    def bucket_collective(output, input, *args, group=None, async_op=False, **kwargs):
        if (kwargs.get("op", torch.distributed.ReduceOp.SUM) in _UNCHANGED_ON_ONE_RANK
                and _same_memory(output, input) and _one_rank(group)):
            return _Done() if async_op else None
        return getattr(torch.distributed, name)(output, input, *args, group=group, async_op=async_op, **kwargs)

    return bucket_collective


_ALL_GATHER, _GATHER = torch.distributed.all_gather, torch.distributed.gather
_ARGS = {_ALL_GATHER: ("tensor_list", "tensor", "group", "async_op"),
         _GATHER: ("tensor", "gather_list", "dst", "group", "async_op")}


class OneRankGathers(TorchFunctionMode):
    """Inside, ``all_gather`` and ``gather`` over a group of one rank copy the tensor into the list's one
    tensor on this thread; every other call passes through. For checkpoint-time functions only."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _ARGS:
            call = {**dict(zip(_ARGS[func], args)), **kwargs}
            parts = call.get("tensor_list", call.get("gather_list"))
            if parts is not None and len(parts) == 1 and _one_rank(call.get("group")):
                parts[0].copy_(call["tensor"])
                return _Done() if call.get("async_op") else None
        return func(*args, **kwargs)


def register(registry, versions: str) -> None:
    reason = ("on one rank it changes nothing, and gloo's copies on its worker thread leave libgomp throttling "
              "the training thread's OpenMP waits")
    for name in ("dist_reduce_scatter_func", "dist_all_gather_func"):
        registry.wrap(f"{_BUFFERS}:{name}", skips_one_rank_in_place, versions=versions, backends=("cpu",),
                      rebind_copies=False, reason=f"the distributed optimizer's per-step bucket collective: {reason}")
    registry.wrap(f"{_DISTRIB}.get_parameter_state_dp_zero", runs_under(OneRankGathers), versions=versions,
                  backends=("cpu",), reason=f"the distributed optimizer's gather of its state at a save: {reason}")

"""Collectives whose tensor shapes NCCL accepts and gloo refuses, on the cpu backend.

``all_gather_into_tensor`` on NCCL (and HCCL) needs only that the output hold ``world`` times the input's
elements. ``ProcessGroupGloo`` also wants the output's leading dimension to be ``world`` times the input's
with the other dimensions equal ("invalid tensor size at index 0"), so megatron's gathers of an N-d tensor
into a flat buffer fail on gloo.

``all_gather`` into a list of tensors of different sizes is documented by torch ("uneven sized tensors are
supported") and run by NCCL; gloo refuses it ("invalid tensor size at index 1"). megatron relies on it
where ranks own different amounts of data: Megatron-FSDP's gather of an unevenly sharded DTensor (its
checkpoints), and the layer-wise optimizer's parameter all-gather (Muon; 0.17+ also from the gradient
buffer). Those functions run under ``AnySizeAllGather`` on gloo. (The MoE dispatcher's unequal gathers, on
a per-layer path, get a direct wrapper instead: ``patches/moe.py``.)
"""

import functools

import torch
from torch.overrides import TorchFunctionMode

_TP_UTILS = "megatron.core.tensor_parallel.utils"


def gather_split_1d_tensor(tensor, tp_group=None):
    """Stands in for ``tensor_parallel.utils.gather_split_1d_tensor`` on gloo: the ranks' tensors (any
    shape, the same on every rank), flattened and concatenated in rank order, as one 1-d tensor. The input
    goes to the collective flat, so gloo's shape rule holds; the result is megatron's."""
    from megatron.core.utils import get_tensor_model_parallel_group_if_none  # patches import before megatron

    tp_group = get_tensor_model_parallel_group_if_none(tp_group)
    flat = tensor.reshape(-1)
    gathered = torch.empty(flat.numel() * tp_group.size(), dtype=flat.dtype, device=flat.device)
    torch.distributed.all_gather_into_tensor(gathered, flat, group=tp_group)
    return gathered


class _Done:
    """The handle of a gather already done: what ``all_gather(..., async_op=True)`` gets back from
    ``all_gather_any_sizes``."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def all_gather_any_sizes(tensor_list, tensor, group=None, async_op=False):
    """``torch.distributed.all_gather`` as NCCL runs it, where the ranks' tensors may differ in size: each
    rank's tensor, padded to the longest, is gathered flat with ``all_gather_into_tensor`` (equal sizes,
    which gloo takes) and each rank's part copied into ``tensor_list``. ``tensor`` may be one of the list's
    tensors (megatron gathers in place). The gather is done before this returns even where ``async_op``
    asks for a handle: megatron waits on the last of several handles only (NCCL completes them in order),
    so a copy left to a handle's ``wait`` might never run."""
    if all(out.shape == tensor.shape for out in tensor_list):
        return _ALL_GATHER(tensor_list, tensor, group=group, async_op=async_op)
    longest = max(out.numel() for out in tensor_list)
    padded = tensor.new_zeros(longest)
    padded[:tensor.numel()] = tensor.reshape(-1)
    gathered = tensor.new_empty(len(tensor_list) * longest)  # flat: gloo's shape rule (module doc)
    torch.distributed.all_gather_into_tensor(gathered, padded, group=group)
    for out, part in zip(tensor_list, gathered.view(len(tensor_list), longest)):
        out.copy_(part[:out.numel()].view(out.shape))
    return _Done() if async_op else None


_ALL_GATHER = torch.distributed.all_gather
_ALL_GATHER_ARGS = ("tensor_list", "tensor", "group", "async_op")


class AnySizeAllGather(TorchFunctionMode):
    """Inside, ``torch.distributed.all_gather`` takes tensors of different sizes (``all_gather_any_sizes``);
    every other torch call passes through. For the few once-per-step or checkpoint-time functions that
    gather uneven parts, on gloo only."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _ALL_GATHER:
            return all_gather_any_sizes(**dict(zip(_ALL_GATHER_ARGS, args)), **kwargs)
        return func(*args, **kwargs)


def gathers_any_sizes(fn):
    """``fn`` run under ``AnySizeAllGather``: the registry's wrapper for megatron's uneven gathers."""

    @functools.wraps(fn)
    def gathering(*args, **kwargs):
        with AnySizeAllGather():
            return fn(*args, **kwargs)

    return gathering


def layer_wise_param_sync_gathers_any_sizes(start_param_sync):
    """``_ParamAndGradBucketGroup.start_param_sync`` under ``AnySizeAllGather`` on its layer-wise path only
    (0.17+: a bucket group without ``use_distributed_optimizer``, where each rank owns whole parameters).
    The distributed optimizer's gather, once per bucket group each step, gathers equal shards and runs
    as written, with no mode around it."""
    gathering = gathers_any_sizes(start_param_sync)

    @functools.wraps(start_param_sync)
    def param_sync(self, *args, **kwargs):
        if self.ddp_config.use_distributed_optimizer:
            return start_param_sync(self, *args, **kwargs)
        return gathering(self, *args, **kwargs)

    return param_sync


_UNEVEN = "megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor"
# (target, its wrapper, where it gathers uneven parts, whether some checked release lacks it)
_UNEVEN_GATHERS = (
    (f"{_UNEVEN}:_assemble_full_tensor_from_uneven_chunks", gathers_any_sizes, "0.16-0.17", True),
    (f"{_UNEVEN}:uneven_dtensor_to_full_tensor", gathers_any_sizes, "0.18+", True),
    ("megatron.core.optimizer.layer_wise_optimizer:LayerWiseDistributedOptimizer.allgather_params",
     gathers_any_sizes, "every release", False),
    ("megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBucketGroup.start_param_sync",
     layer_wise_param_sync_gathers_any_sizes, "0.17+, layer-wise path only", False),
)


def register(registry, versions: str) -> None:
    registry.replace(f"{_TP_UTILS}:gather_split_1d_tensor", gather_split_1d_tensor, versions=versions,
                     backends=("cpu",),
                     reason="gathers an N-d tensor into a flat buffer, which gloo's all_gather_into_tensor refuses")
    for target, wrapper, where, optional in _UNEVEN_GATHERS:
        registry.wrap(target, wrapper, versions=versions, backends=("cpu",), optional=optional,
                      reason=f"all_gather of unequal sizes, which NCCL runs and gloo refuses ({where})")

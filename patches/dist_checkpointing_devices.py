"""megatron's distributed checkpointing, fully parallel load off CUDA: the buffers it receives tensors into
are placed on "cuda" through a helper of another module, and its ``gather_rounds`` exchange leans on an
all-gather of tensors of different sizes, which NCCL and HCCL carry out and gloo refuses."""

import functools

import torch
from torch.overrides import TorchFunctionMode

from adapter import torch_view

_MAPPING = "megatron.core.dist_checkpointing.mapping"
_EXCHANGE = "megatron.core.dist_checkpointing.exchange_utils"


def init_data_on_this_device(init_data):
    """Registry wrapper for ``ShardedTensor.init_data(device, init_fn=torch.empty)``.

    The fully parallel load (``FullyParallelLoadStrategyWrapper``) allocates the buffer a rank receives a
    tensor into with ``ShardedTensor.init_data("cuda")`` (``exchange_utils._get_empty_tensor_for_exchange``,
    for the ShardedTensors that hold no data yet, as ``load_tensors_metadata`` / ``load_plain_tensors``
    give them). The string is an argument: mapping.py, where it reaches ``torch.empty``, spells no CUDA
    device, so the routing rule (adapter.cuda_routing) leaves that module's ``torch.empty`` alone and it
    raised "Torch not compiled with CUDA enabled". A CUDA device (or a bare index) given to ``init_data`` is
    routed to this backend's device, as the view routes a literal one; any other device passes unchanged."""

    @functools.wraps(init_data)
    def routed_init_data(self, device, *args, **kwargs):
        return init_data(self, torch_view.route_device(device), *args, **kwargs)

    return routed_init_data


def _gather_padded(tensor_list, tensor, group=None, async_op=False):
    """``all_gather`` of tensors whose sizes differ across ranks (every rank knows them all, as megatron's
    caller does): each rank's tensor padded to the largest, one even all-gather, each result cut back."""
    size = max(t.numel() for t in tensor_list)
    mine = torch.zeros(size, dtype=tensor.dtype, device=tensor.device)
    mine[:tensor.numel()] = tensor.reshape(-1)
    gathered = [torch.empty_like(mine) for _ in tensor_list]
    torch.distributed.all_gather(gathered, mine, group=group)
    for out, received in zip(tensor_list, gathered):
        out.copy_(received[:out.numel()].view(out.shape))


class _UnevenAllGather(TorchFunctionMode):
    """Within one function: an all-gather whose tensors differ in size runs as ``_gather_padded``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.distributed.all_gather and not kwargs.get("async_op"):
            tensor_list = kwargs.get("tensor_list", args[0] if args else None)
            if len({t.shape for t in tensor_list}) > 1:
                tensor = kwargs.get("tensor", args[1] if len(args) > 1 else None)
                return _gather_padded(tensor_list, tensor, group=kwargs.get("group"))
        return func(*args, **kwargs)


def uneven_all_gather_on_gloo(gather_rounds):
    """Registry wrapper for ``exchange_utils.exchange_loaded_tensors_gather_rounds``.

    Each round all-gathers one tensor from every rank, and the ranks' tensors differ in size (a rank with
    nothing left sends an empty one). ``ProcessGroupNCCL`` (and torch_npu's ``ProcessGroupHCCL``) handle an
    uneven all-gather by a series of broadcasts; ``ProcessGroupGloo`` raises "invalid tensor size". On the
    cpu backend those all-gathers are padded to one size; even ones, and every other collective, pass as
    they are."""

    @functools.wraps(gather_rounds)
    def gather_rounds_on_gloo(*args, **kwargs):
        with _UnevenAllGather():
            return gather_rounds(*args, **kwargs)

    return gather_rounds_on_gloo


def register(registry, versions: str) -> None:
    registry.wrap(f"{_MAPPING}:ShardedTensor.init_data", init_data_on_this_device, versions=versions,
                  backends=("cpu", "npu"),
                  reason="exchange_utils passes the string 'cuda' here, into a module the routing rule leaves alone")
    registry.wrap(f"{_EXCHANGE}:exchange_loaded_tensors_gather_rounds", uneven_all_gather_on_gloo,
                  versions=versions, backends=("cpu",),
                  reason="all-gathers tensors of different sizes, which gloo refuses (NCCL and HCCL broadcast them)")

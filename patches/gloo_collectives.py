"""Collectives whose tensor shapes NCCL and HCCL accept and gloo refuses, on the cpu backend.

``all_gather_into_tensor`` on NCCL (and HCCL) needs only that the output hold ``world`` times the input's
elements. ``ProcessGroupGloo`` also wants the output's leading dimension to be ``world`` times the input's
with the other dimensions equal ("invalid tensor size at index 0"), so megatron's gathers of an N-d tensor
into a flat buffer fail on gloo.
"""

import torch

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


def register(registry, versions: str) -> None:
    registry.replace(f"{_TP_UTILS}:gather_split_1d_tensor", gather_split_1d_tensor, versions=versions,
                     backends=("cpu",),
                     reason="gathers an N-d tensor into a flat buffer, which gloo's all_gather_into_tensor refuses")

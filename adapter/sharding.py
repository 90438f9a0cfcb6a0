"""Sharded data parallelism (Megatron-FSDP, torch FSDP2 through megatron) off CUDA, the mechanism.

Both build a ``torch.distributed.DeviceMesh`` over their process groups with ``device_type="cuda"`` spelled
out (``DeviceMesh.from_group(..., device_type="cuda")``): the mesh's device type is where DTensor puts every
local shard (``DTensor.from_local`` moves the shard there), so off CUDA it must be this backend's device
type. The CUDA routing maps device strings of torch's factories, not a class's arguments; the mesh class
megatron's modules see is this stand-in, which builds torch's own mesh on this backend's device type.
Everything else of Megatron-FSDP (its buffers, streams and events) is answered by the CUDA routing.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
from torch.distributed.device_mesh import DeviceMesh

from adapter import backend, torch_view
from adapter.cuda_only_features import RefusedSetting


class _RoutedMeshType(type):
    """Constructing routes a CUDA device type; isinstance and annotations still mean torch's DeviceMesh."""

    def __call__(cls, device_type, *args, **kwargs):
        return DeviceMesh(torch_view.route_device_type(device_type), *args, **kwargs)

    def __instancecheck__(cls, obj):
        return isinstance(obj, DeviceMesh)

    def __subclasscheck__(cls, other):
        return issubclass(other, DeviceMesh)

    def __getattr__(cls, name):
        return getattr(DeviceMesh, name)


class RoutedDeviceMesh(metaclass=_RoutedMeshType):
    """torch's DeviceMesh, its ``"cuda"`` device type this backend's."""

    @staticmethod
    def from_group(group, device_type, *args, **kwargs):
        return DeviceMesh.from_group(group, torch_view.route_device_type(device_type), *args, **kwargs)


def scaled_before_sum(preprocess):
    """Megatron-FSDP's ``gradient_reduce_preprocessing``: with ``gradient_reduce_div_fusion`` (on by default)
    it asks for NCCL's pre-multiplied sum (``_make_nccl_premul_sum``), which gloo refuses and HCCL does not
    offer. Off CUDA the gradients are scaled first and summed, megatron's own branch for when the fusion is
    off: the same reduction, unfused."""

    def preprocessed(grad_data, scaling_factor, ddp_config):
        if scaling_factor is not None and not ddp_config.average_in_collective:
            grad_data.mul_(scaling_factor)
            return torch.distributed.ReduceOp.SUM
        return preprocess(grad_data, scaling_factor, ddp_config)

    return functools.wraps(preprocess)(preprocessed)


def refuse_unready_fsdp(validate_args):
    """Megatron-LM's ``validate_args``: a Megatron-FSDP run is refused in one line where einops is missing
    (megatron asserts it on every rank when it builds the mesh, after the model is built; megatron-core does
    not install it), and one that saves is refused off CUDA, for now. Its ``fsdp_dtensor`` save waited
    forever on the cpu backend (rank 0 in the all_gather_object of megatron_fsdp's
    ``uneven_dtensor._update_offsets_and_cumulative_shape``, found 2026-11-28, cause not yet known): a
    refusal before training, not a job that hangs at its first save with its work unsaved."""

    @functools.wraps(validate_args)
    def validate(args, *rest, **kwargs):
        if getattr(args, "use_megatron_fsdp", False) and importlib.util.find_spec("einops") is None:
            raise RefusedSetting("--use-megatron-fsdp needs einops, which is not installed (megatron-core does not "
                                 "install it): pip install einops, or megatron-device-adapter[fsdp]")
        if getattr(args, "use_megatron_fsdp", False) and getattr(args, "save", None):
            raise RefusedSetting(
                f"--use-megatron-fsdp with --save {args.save}: saving a Megatron-FSDP checkpoint is not supported "
                f"off CUDA yet (its fsdp_dtensor save does not finish on the {backend.current().name} backend); "
                "train without --save, or shard with --use-distributed-optimizer, which saves on every backend")
        return validate_args(args, *rest, **kwargs)

    return validate

"""Sharded data parallelism (Megatron-FSDP, torch FSDP2 through megatron) off CUDA, the mechanism.

Both build a ``torch.distributed.DeviceMesh`` over their process groups with ``device_type="cuda"`` spelled
out (``DeviceMesh.from_group(..., device_type="cuda")``): the mesh's device type is where DTensor puts every
local shard (``DTensor.from_local`` moves the shard there), so off CUDA it must be this backend's device
type. The CUDA routing maps device strings of torch's factories, not a class's arguments; the mesh class
megatron's modules see is this stand-in, which builds torch's own mesh on this backend's device type.
Everything else of Megatron-FSDP (its buffers, streams and events) is answered by the CUDA routing. Its
fsdp_dtensor checkpoint needs every rank's optimizer state to name the same parameters, which torch's AdamW
(megatron's Adam without TE) does not do for empty shards: ``every_shard_in_optimizer_state``.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
from torch.distributed.device_mesh import DeviceMesh

from adapter import torch_view
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


def every_shard_in_optimizer_state(sharded_param_state):
    """``DistributedOptimizer.sharded_param_state_fsdp_dtensor``: the fsdp_dtensor optimizer state names every
    parameter on every rank, those whose shard on this rank is empty too.

    megatron_fsdp's save (and load) preprocessing, ``preprocess_state_dict_for_uneven_dtensor``, runs one
    ``all_gather_object`` over the DP group per DTensor of the state dict, so every rank must hold the same
    DTensors. Megatron-FSDP leaves ``grad`` None on a parameter whose shard on this rank is empty; TE's FusedAdam
    (megatron's Adam where TE is installed) still makes its state, but torch's AdamW (megatron's Adam without TE
    and apex: every NPU and CPU) makes state only for parameters with a gradient. So at DP2 the rank whose shard
    of, say, ``linear_proj.weight`` is empty held 55 DTensors to the other's 65, left the gathers early for
    torch's save, and the other rank waited forever in ``_update_offsets_and_cumulative_shape``'s
    ``all_gather_object`` (a load would hang the same way). Here such a parameter gets the state TE's FusedAdam
    gives it: empty tensors, and a step, the one its group's other parameters have, so that every rank writes the
    same value under the same name (a resumed run's second save included). Where every parameter has its state
    already (TE), nothing changes."""

    @functools.wraps(sharded_param_state)
    def sharded(self, is_loading=False):
        state_dict = sharded_param_state(self, is_loading)
        for param, state in _empty_shard_states(self.optimizer):
            state_dict["state"][self._param_name(param)] = state
        return state_dict

    return sharded


def _empty_shard_states(optimizer):
    """(param, state) of each parameter whose local shard is empty, its state shaped as another parameter's of
    its group (or of any group): tensors empty as the shard, scalars (the step) that parameter's. A state made
    here keeps its tensors and has its step refreshed: torch's AdamW never steps a parameter without a gradient."""
    def has_shard(param):
        return getattr(param, "_local_tensor", param).numel() > 0

    def peer_of(params):
        return next((optimizer.state[p] for p in params if has_shard(p) and optimizer.state.get(p)), None)

    fallback = peer_of(p for group in optimizer.param_groups for p in group["params"])
    for group in optimizer.param_groups:
        peer = peer_of(group["params"]) or fallback
        for param in group["params"]:
            if has_shard(param) or peer is None:
                continue
            state = optimizer.state[param]
            fresh = not state
            for key, value in peer.items():
                if torch.is_tensor(value) and value.dim() > 0:
                    state.setdefault(key, torch.zeros_like(param, dtype=value.dtype))
                elif fresh or key in state:
                    state[key] = value.clone() if torch.is_tensor(value) else value
            yield param, state


def refuse_unready_fsdp(validate_args):
    """Megatron-LM's ``validate_args``: a Megatron-FSDP run is refused in one line where einops is missing
    (megatron asserts it on every rank when it builds the mesh, after the model is built; megatron-core does
    not install it)."""

    @functools.wraps(validate_args)
    def validate(args, *rest, **kwargs):
        if getattr(args, "use_megatron_fsdp", False) and importlib.util.find_spec("einops") is None:
            raise RefusedSetting("--use-megatron-fsdp needs einops, which is not installed (megatron-core does not "
                                 "install it): pip install einops, or megatron-device-adapter[fsdp]")
        return validate_args(args, *rest, **kwargs)

    return validate

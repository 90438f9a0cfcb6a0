"""Sharded data parallelism (Megatron-FSDP, torch FSDP2 through megatron) off CUDA, the mechanism.

Both build a ``torch.distributed.DeviceMesh`` over their process groups with ``device_type="cuda"`` spelled
out (``DeviceMesh.from_group(..., device_type="cuda")``): the mesh's device type is where DTensor puts every
local shard (``DTensor.from_local`` moves the shard there), so off CUDA it must be this backend's device
type. The CUDA routing maps device strings of torch's factories, not a class's arguments; the mesh class
megatron's modules see is this stand-in, which builds torch's own mesh on this backend's device type.
Everything else of Megatron-FSDP (its buffers, streams and events) is answered by the CUDA routing. Its
fsdp_dtensor checkpoint needs every rank's optimizer state to name the same parameters, which torch's AdamW
(megatron's Adam without TE) does not do for empty shards: ``every_shard_in_optimizer_state``; Megatron-LM's
split of a SwiGLU model's ``linear_fc1`` for that checkpoint must find its parameters in the module it is
handed (on every backend): ``swiglu_split_finds_its_parameters``.

torch FSDP2's torch_dist checkpoint needs two fixes that are not about the device (so they apply on every
backend): megatron matches optimizer state to the model's sharded tensors by the id of each parameter's
local shard, which torch 2.13 no longer hands out (``local_shard_ids``), and Megatron-LM's in-place load for
FSDP2 leaves torch Adam's step behind (``fsdp2_resumes_adam_step``).
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
    same value under the same name (a resumed run's second save included). The states are in the optimizer's
    parameter order on every rank, as TE's FusedAdam makes them: torch's AdamW makes them in the order gradients
    first came, which differs between ranks (at EP1 under DP2, each rank's own experts first), and megatron's
    SwiGLU split of this state (``handle_swiglu_in_state_dict``) gathers once per ``linear_fc1`` in the order it
    finds them, so a MoE model's save paired one rank's expert with another's. Where every parameter has its
    state already (TE), nothing changes."""

    @functools.wraps(sharded_param_state)
    def sharded(self, is_loading=False):
        state_dict = sharded_param_state(self, is_loading)
        for param, state in _empty_shard_states(self.optimizer):
            state_dict["state"][self._param_name(param)] = state
        params = [self._param_name(p) for group in self.optimizer.param_groups for p in group["params"]]
        state = state_dict["state"]
        state_dict["state"] = {**{name: state[name] for name in params if name in state}, **state}
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


def swiglu_split_finds_its_parameters(handle_swiglu):
    """megatron's ``handle_swiglu_in_state_dict`` splits each SwiGLU ``linear_fc1`` of an fsdp_dtensor
    checkpoint (the weight and its Adam moments) into its gate and up halves (``_w``, ``_v``), so that the
    checkpoint reshards across TP and DP. It finds the parameter of a model key as ``module.<key>`` and of an
    optimizer key as that key less its first ``module.``: names in megatron's FullyShardedDataParallel and in
    the MegatronFSDP module inside it. Megatron-LM hands it the MegatronFSDP module (``unwrap_model`` peels only
    the outer wrapper), where the first spelling names nothing: every save and load of a ``--swiglu`` model with
    ``--use-megatron-fsdp --ckpt-format fsdp_dtensor`` stopped (AttributeError on every rank, CUDA too;
    NVIDIA/Megatron-LM issues 2035 and 5265; megatron-core 0.16.1 to 0.19.2 and upstream main alike). It is
    handed the model with a lookup that, where a name is not there, tries it without its first ``module.``:
    both spellings find the parameter; a name the model has resolves as before."""

    @functools.wraps(handle_swiglu)
    def handle(model, model_state_dict, optimizer_state_dict):
        return handle_swiglu(_PrefixTolerantLookup(model), model_state_dict, optimizer_state_dict)

    return handle


class _PrefixTolerantLookup:
    """``model`` (every attribute its own), its ``get_parameter`` also answering a name with one wrapper
    ``module.`` too many."""

    def __init__(self, model):
        self._model = model

    def __getattr__(self, name):
        return getattr(self._model, name)

    def get_parameter(self, target: str):
        try:
            return self._model.get_parameter(target)
        except AttributeError:
            if not target.startswith("module."):
                raise
            return self._model.get_parameter(target[len("module."):])


def require_einops() -> None:
    """Megatron-FSDP's mesh needs einops, which megatron-core does not install (megatron asserts it on every
    rank when it builds the mesh, after the model is built): one line before that."""
    if importlib.util.find_spec("einops") is None:
        raise RefusedSetting("--use-megatron-fsdp needs einops, which is not installed (megatron-core does not "
                             "install it): pip install einops, or megatron-device-adapter[fsdp]")


def local_shard_ids(optim_params_iter) -> dict[int, int]:
    """megatron's ``get_optim_param_to_id_map`` for torch FSDP2's parameters: the id of each parameter's
    local shard (``DTensor._local_tensor``, which the model's sharded state dict holds) -> its optimizer
    index. megatron takes ``to_local()`` under no_grad, which was that tensor until torch made ``to_local()``
    of a ``Parameter(DTensor)`` a fresh view (pytorch gh-166156, in torch 2.13): then no id matches and the
    first save stops with "Param id 0 does not match any model sharded param", on every device."""
    mapping = {}
    for index, param in enumerate(optim_params_iter):
        mapping.setdefault(id(getattr(param, "_local_tensor", param)), index)
    return mapping


def fsdp2_resumes_adam_step(load_checkpoint):
    """Megatron-LM's ``load_checkpoint`` with torch FSDP2 and torch_dist loads the model and optimizer tensors
    in place (``skip_load_to_model_and_opt``) and so never calls ``optimizer.load_state_dict``, which is what
    puts the optimizer's step (saved once, as ``common_step``) back into each parameter's state. torch's Adam
    (the optimizer wherever Transformer Engine's FusedAdam is not, which keeps its step per group) then finds
    no ``step`` at the first resumed iteration (KeyError). The saved step is read back from the checkpoint's
    common state and restored where the state lacks it."""

    @functools.wraps(load_checkpoint)
    def load(ddp_model, optimizer, opt_param_scheduler, load_arg="load", *args, **kwargs):
        loaded = load_checkpoint(ddp_model, optimizer, opt_param_scheduler, load_arg, *args, **kwargs)
        if kwargs.get("skip_load_to_model_and_opt") and optimizer is not None and loaded[0] > 0:
            _restore_saved_step(load_checkpoint.__module__, load_arg, loaded[0], optimizer)
        return loaded

    return load


def _restore_saved_step(checkpointing_module: str, load_arg: str, iteration: int, optimizer) -> None:
    from megatron.training import get_args

    checkpointing = importlib.import_module(checkpointing_module)
    restore_saved_step(checkpointing.get_checkpoint_name(getattr(get_args(), load_arg), iteration,
                                                         return_base_dir=True), optimizer)


def restore_saved_step(directory, optimizer) -> None:
    """Put the step of the torch_dist checkpoint in ``directory`` into each parameter's state of
    ``optimizer`` (a megatron optimizer, chained or not) that lacks one, as its ``load_state_dict`` would."""
    from megatron.core import dist_checkpointing

    saved = dist_checkpointing.load_common_state_dict(directory).get("optimizer", {})
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    states = [saved] if len(inner) == 1 else [saved.get(i, {}) for i in range(len(inner))]
    for part, state in zip(inner, states):
        state = state.get("optimizer", state)  # the mixed-precision optimizers nest torch's state dict
        step = state.get("state", {}).get("common_step")
        torch_state = getattr(getattr(part, "optimizer", None), "state", {})
        if step is not None and any("step" not in s for s in torch_state.values()):
            part._restore_common_per_param_step({"state": torch_state}, step)


def fsdp_requirements_in_one_line(validate_args):
    """Megatron-LM's ``validate_args`` asserts what its FSDPs need: torch FSDP2 untied embedding and output
    weights, torch_dist or torch_dcp checkpoints, no distributed optimizer, no pipeline or expert parallelism,
    no fp16; Megatron-FSDP ``--ckpt-format fsdp_dtensor``, which is Megatron-FSDP's alone. Each is a traceback on
    every rank. With ``--use-torch-fsdp2``, ``--use-megatron-fsdp`` or ``--ckpt-format fsdp_dtensor`` its FSDP
    assertions are said once for the job instead, in Megatron-LM's own words (``adapter.run`` prints a
    RefusedSetting from rank 0); so is a Megatron-FSDP run without einops (``require_einops``), which megatron
    would meet at its first import of the FSDP package, on every rank."""

    @functools.wraps(validate_args)
    def validate(args, *rest, **kwargs):
        if getattr(args, "use_megatron_fsdp", False):
            require_einops()
        try:
            return validate_args(args, *rest, **kwargs)
        except AssertionError as exc:
            if _asks_fsdp(args) and "fsdp" in str(exc).lower():
                raise RefusedSetting(f"{exc} (Megatron-LM's check)") from None
            raise

    return validate


def _asks_fsdp(args) -> bool:
    return bool(getattr(args, "use_torch_fsdp2", False) or getattr(args, "use_megatron_fsdp", False)
                or getattr(args, "ckpt_format", None) == "fsdp_dtensor")

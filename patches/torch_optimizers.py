"""megatron-core's distributed optimizer over torch's own Adam (no apex, no Transformer Engine).

That is every CPU run, NPU runs without apex, and CUDA runs without apex/TE, so it is patched on all
backends.
"""

import functools
import os
import sys

import torch

_MODULE = "megatron.core.optimizer.distrib_optimizer"
_DISTRIB = f"{_MODULE}:DistributedOptimizer"


def _torch_optimizer_inside() -> bool:
    return not sys.modules[_MODULE].HAVE_APEX_OR_TE


def state_dict_before_first_step(state_dict):
    """Registry wrapper for ``DistributedOptimizer.state_dict``.

    With torch's Adam, megatron reads the iteration from the per-parameter ``step`` states and asserts
    there is exactly one; before the first step there are none (no state yet, or only the moments that
    megatron's ``init_state_fn`` puts there to shape a checkpoint, without ``step``), so building the state
    dict to save or load a checkpoint before training fails (assertion, or ``KeyError: 'step'``). Before
    the first step, the answer is step 0, a float as megatron's own answer is once there are steps (the
    per-parameter step's ``.item()``): a state dict taken before a save equals the one taken after its
    load."""

    @functools.wraps(state_dict)
    def optimizer_state_dict(self):
        if not _torch_optimizer_inside() or any("step" in state for state in self.optimizer.state.values()):
            return state_dict(self)
        inner = self.optimizer.state_dict()
        groups = [{**{k: v for k, v in group.items() if k != "params"}, "step": 0.0}
                  for group in inner["param_groups"]]
        result = {"optimizer": {"param_groups": groups}}
        if self.grad_scaler:
            result["grad_scaler"] = self.grad_scaler.state_dict()
        return result

    return optimizer_state_dict


def unshared_steps_after_load(load_state_dict):
    """Registry wrapper for ``DistributedOptimizer.load_state_dict``.

    With torch's Adam, megatron gives every parameter's state the *same* ``step`` tensor; Adam adds 1
    to each parameter's step in place, so after a resume one iteration would advance the shared step
    once per parameter and skew Adam's bias correction. Each parameter gets its own copy, on the device
    its group's kernel wants it (``_own_step``)."""

    @functools.wraps(load_state_dict)
    def load_optimizer_state_dict(self, state_dict):
        result = load_state_dict(self, state_dict)
        if _torch_optimizer_inside():
            for group in self.optimizer.param_groups:
                on_device = bool(group.get("fused") or group.get("capturable"))
                for param in group["params"]:
                    state = self.optimizer.state.get(param, {})
                    if "step" in state:
                        state["step"] = _own_step(state["step"], param, on_device)
        return result

    return load_optimizer_state_dict


def _own_step(step, param, on_device: bool):
    """A copy of ``step`` where torch's Adam keeps it: a float32 scalar on the parameter's device for the
    fused and capturable kernels (the fused CUDA kernel refuses a CPU step, and a checkpoint's step is
    loaded on the CPU), on the CPU for foreach."""
    return torch.as_tensor(step, dtype=torch.float32).to(param.device if on_device else "cpu", copy=True)


def step_from_param_groups(set_states):
    """Registry wrapper for ``_set_main_param_and_optimizer_states``.

    torch's Adam keeps a per-parameter ``step``. Megatron restores it from the checkpoint's param
    groups in ``load_state_dict`` and then copies the per-parameter tensors over the state, which goes
    wrong both ways: the fully_reshardable loader leaves ``step`` out and this setter raises
    KeyError('step'); the dp_reshardable loader passes the load template's ``step`` (0), so Adam's bias
    correction silently restarts after every resume. ``step`` keeps the restored value."""

    @functools.wraps(set_states)
    def set_main_param_and_optimizer_states(self, model_param, tensors):
        if not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            current = self.optimizer.state[main_param]
            if "step" in current:
                tensors = {**tensors, "step": current["step"]}
        return set_states(self, model_param, tensors)

    return set_main_param_and_optimizer_states


def fused_torch_adam(build):
    """Registry wrapper for ``_get_megatron_optimizer_based_on_param_groups``.

    Megatron builds torch's Adam with torch's default, the foreach implementation; torch's fused kernel
    (CPU and CUDA, float32/float64/float16/bfloat16) updates each tensor in one pass instead of a dozen
    foreach ops over all of them. ``ADAPTER_FUSED_ADAM=0`` keeps foreach (to measure the difference)."""

    @functools.wraps(build)
    def build_optimizer(*args, **kwargs):
        optimizer = build(*args, **kwargs)
        inner = _built_torch_optimizer(optimizer)
        if os.environ.get(FUSED_ADAM_ENV) != "0" and isinstance(inner, torch.optim.Adam) and all(
                p.device.type in _FUSED_ADAM_DEVICES and p.dtype in _FUSED_ADAM_DTYPES
                for group in inner.param_groups for p in group["params"]):
            for group in inner.param_groups:
                group.update(fused=True, foreach=None)
            inner.defaults.update(fused=True, foreach=None)
        return optimizer

    return build_optimizer


FUSED_ADAM_ENV = "ADAPTER_FUSED_ADAM"
_FUSED_ADAM_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_FUSED_ADAM_DEVICES = ("cpu", "cuda")  # where torch has the fused kernel (not NPU)


def _built_torch_optimizer(built):
    """The torch optimizer ``_get_megatron_optimizer_based_on_param_groups`` built: inside the megatron
    optimizer it returns, or (0.17 and later, with ``skip_megatron_wrapping=True``, the layer-wise
    optimizer's call) first in the ``(torch optimizer, init_state_fn)`` pair it returns instead."""
    if isinstance(built, tuple):
        return built[0]
    return getattr(built, "optimizer", None)


def _torch_optimizers(optimizer):
    """The torch optimizers inside a megatron optimizer (one, or one per chained optimizer), or the one of
    a ``(torch optimizer, init_state_fn)`` pair."""
    if isinstance(optimizer, tuple):
        yield from (inner for inner in optimizer[:1] if isinstance(inner, torch.optim.Optimizer))
        return
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(chained, "optimizer", None)
        if isinstance(inner, torch.optim.Optimizer):
            yield inner


def learning_rate_set_later(build):
    """Registry wrapper for ``_get_megatron_optimizer_based_on_param_groups``.

    ``OptimizerConfig.lr`` may be None where something else sets each group's ``lr`` before the first step
    (megatron's dist_checkpointing tests build optimizers so, only to save and load their state).
    Transformer Engine's and apex's Adam accept None; torch's Adam and SGD, which megatron builds without
    them, refuse it (``TypeError: '<=' not supported between instances of 'float' and 'NoneType'``). They
    are built with a stand-in 0.0, and their groups then hold None again, as the fused optimizers' would:
    a step without an lr fails as it would there."""

    @functools.wraps(build)
    def build_optimizer(config, *args, **kwargs):
        if config.lr is not None or not _uses_torch_optimizer():
            return build(config, *args, **kwargs)
        config.lr = 0.0
        try:
            optimizer = build(config, *args, **kwargs)
        finally:
            config.lr = None
        for inner in _torch_optimizers(optimizer):
            inner.defaults["lr"] = None
            for group in inner.param_groups:
                if group["lr"] == 0.0:
                    group["lr"] = None
        return optimizer

    return build_optimizer


def _uses_torch_optimizer() -> bool:
    return getattr(sys.modules.get("megatron.core.optimizer"), "USING_PYTORCH_OPTIMIZER", False)


def per_parameter_steps(load_state_dict):
    """Registry wrapper for the non-distributed optimizers' ``load_state_dict`` (fp32 and float16).

    Transformer Engine's and apex's Adam keep ``step`` in each param group; torch's Adam keeps it in each
    parameter's state and refuses a state without one (``KeyError: 'step'``). So a checkpoint written with
    the fused Adam (on a GPU, say), or moments filled in that layout, could not be loaded where megatron
    builds torch's Adam (CPU, NPU without apex). A parameter state without ``step`` gets its group's
    (0 when the group has none either: no step was taken); megatron's own ``common_step`` goes first."""

    @functools.wraps(load_state_dict)
    def load_with_steps(self, state_dict, *args, **kwargs):
        if isinstance(getattr(self, "optimizer", None), torch.optim.Adam):
            key = next((k for k in ("optimizer", "optimizer_state_dict") if k in state_dict), None)
            _fill_steps(state_dict[key] if key else state_dict)
        return load_state_dict(self, state_dict, *args, **kwargs)

    return load_with_steps


def _fill_steps(optimizer_state: dict) -> None:
    states = optimizer_state.get("state", {})
    if "common_step" in states:
        return
    group_steps = {index: group.get("step", 0) for group in optimizer_state.get("param_groups", [])
                   for index in group.get("params", [])}
    for index, state in states.items():
        if state and "step" not in state:
            state["step"] = float(group_steps.get(index, 0))  # torch's Adam makes it its scalar tensor


def register(registry, versions: str) -> None:
    for owner in ("FP32Optimizer", "Float16OptimizerWithFloat16Params"):
        registry.wrap(f"megatron.core.optimizer.optimizer:{owner}.load_state_dict", per_parameter_steps,
                      versions=versions,
                      reason="torch's Adam refuses states without a per-parameter 'step' (TE/apex keep it per group)")
    registry.wrap("megatron.core.optimizer:_get_megatron_optimizer_based_on_param_groups",
                  learning_rate_set_later, versions=versions,
                  reason="torch's Adam and SGD refuse lr=None, which TE's and apex's Adam accept until a step")
    registry.wrap("megatron.core.optimizer:_get_megatron_optimizer_based_on_param_groups", fused_torch_adam,
                  versions=versions, backends=("cpu", "cuda"),
                  reason="torch's Adam on CPU/CUDA parameters runs its fused kernel, not the foreach default")
    registry.wrap(f"{_DISTRIB}.state_dict", state_dict_before_first_step, versions=versions,
                  reason="with torch's Adam, state_dict() fails before the first step (no 'step' yet)")
    registry.wrap(f"{_DISTRIB}.load_state_dict", unshared_steps_after_load, versions=versions,
                  reason="with torch's Adam, loading shares one 'step' tensor that each param then bumps")
    registry.wrap(f"{_DISTRIB}._set_main_param_and_optimizer_states", step_from_param_groups,
                  versions=versions,
                  reason="with torch's Adam, loading resets (dp_reshardable) or loses (fully_) 'step'")

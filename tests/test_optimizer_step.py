"""The optimizer step off apex: foreach stand-ins for its multi-tensor kernels, torch's fused Adam on CPU."""

import pytest
import torch

import adapter  # noqa: F401 - before megatron
from patches import multi_tensor
from scripts.train_tiny_gpt import Run, build, setup
from tests.distributed import run_ranks


def _grads(seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for shape in ((3, 5), (7,), (2, 2, 4))]


def test_scale_in_place_and_into_other_tensors():
    srcs = _grads()
    want = [g * 0.25 for g in srcs]
    dsts = [torch.empty_like(g) for g in srcs]
    multi_tensor.multi_tensor_scale(2048, None, [srcs, dsts], 0.25)
    assert all(torch.equal(d, w) for d, w in zip(dsts, want))
    assert not torch.equal(srcs[0], want[0])  # sources untouched
    multi_tensor.multi_tensor_scale(2048, None, [srcs, srcs], 0.25)
    assert all(torch.equal(s, w) for s, w in zip(srcs, want))


def test_l2_norm_is_the_norm_of_all_tensors_together():
    grads = _grads()
    norm, per_tensor = multi_tensor.multi_tensor_l2_norm(2048, None, [grads], False)
    assert per_tensor is None and norm.shape == (1,) and norm.dtype == torch.float32
    assert norm.item() == pytest.approx(torch.cat([g.flatten() for g in grads]).norm().item(), rel=1e-6)


def test_megatron_clipping_holds_the_foreach_versions():
    """clip_grads and optimizer bound megatron's local versions by value at import: the registry rebinds
    those copies too."""
    from megatron.core.optimizer import clip_grads, optimizer

    assert clip_grads.multi_tensor_scale_impl is multi_tensor.multi_tensor_scale
    assert clip_grads.l2_norm_impl is multi_tensor.multi_tensor_l2_norm
    assert optimizer.multi_tensor_scale_impl is multi_tensor.multi_tensor_scale


def clip_and_build(distributed_optimizer: bool) -> dict:
    """In a rank: megatron's grad-norm and clipping on CPU grads, and the Adam megatron builds."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32, get_grad_norm_fp32

    run = Run(distributed_optimizer=distributed_optimizer)
    setup(run)
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in _grads()]
    for param, grad in zip(params, _grads()):
        param.grad = grad
    norm = get_grad_norm_fp32([p.grad for p in params])
    clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=norm)
    _, _, _, optimizer = build(run)
    groups = [group for opt in getattr(optimizer, "chained_optimizers", [optimizer])
              for group in opt.optimizer.param_groups]
    return {"norm": norm, "clipped_norm": torch.cat([p.grad.flatten() for p in params]).norm().item(),
            "fused": [group["fused"] for group in groups], "foreach": [group["foreach"] for group in groups]}


@pytest.mark.multiproc
@pytest.mark.parametrize("distributed_optimizer", [False, True], ids=["adam", "distributed-adam"])
def test_megatron_clips_on_cpu_and_builds_torch_adam_fused(distributed_optimizer):
    result = run_ranks(1, clip_and_build, distributed_optimizer)[0]
    want = torch.cat([g.flatten() for g in _grads()]).norm().item()
    assert result["norm"] == pytest.approx(want, rel=1e-6)
    assert result["clipped_norm"] == pytest.approx(1.0, rel=1e-5)
    assert result["fused"] and all(result["fused"]) and not any(result["foreach"])


def losses_with_the_lr_set_later(lr_in_config) -> dict:
    """In a rank: megatron's optimizer built from ``OptimizerConfig(lr=lr_in_config)``; when that is None,
    every group's lr is set afterwards, before the first step."""
    from scripts.train_tiny_gpt import train_step

    run = Run(lr=lr_in_config, distributed_optimizer=True, steps=3)
    flavor, _, chunks, optimizer = setup(run)
    groups = [group for opt in getattr(optimizer, "chained_optimizers", [optimizer])
              for group in opt.optimizer.param_groups]
    built_with = [group["lr"] for group in groups]
    for group in groups:
        group["lr"] = 1e-3
    return {"built_with": built_with,
            "losses": [train_step(run, flavor, chunks, optimizer, step)[0] for step in range(run.steps)]}


@pytest.mark.multiproc
def test_an_optimizer_config_without_lr_builds_torch_adam_with_the_lr_to_be_set():
    """Transformer Engine's and apex's Adam take lr=None until something sets it; torch's, built in their
    place, gets the same: None in its groups, then the value set, as if given from the start."""
    later = run_ranks(1, losses_with_the_lr_set_later, None)[0]
    given = run_ranks(1, losses_with_the_lr_set_later, 1e-3)[0]
    assert later["built_with"] and set(later["built_with"]) == {None}
    assert later["losses"] == given["losses"]


def steps_in_a_checkpoint_before_training(_) -> dict:
    """In a rank: the steps of the distributed optimizer's state dict (what a checkpoint saves) before any
    step, and after one, as megatron itself reads them from torch's Adam."""
    from scripts.train_tiny_gpt import train_step

    run = Run(distributed_optimizer=True, steps=1)
    flavor, _, chunks, optimizer = setup(run)
    optimizer.sharded_state_dict(chunks[0].sharded_state_dict(),
                                 metadata={"distrib_optim_sharding_type": "dp_reshardable"})
    inner = optimizer.chained_optimizers[0] if hasattr(optimizer, "chained_optimizers") else optimizer
    assert inner.optimizer.state and not any("step" in s for s in inner.optimizer.state.values())
    before = [group["step"] for group in inner.state_dict()["optimizer"]["param_groups"]]
    train_step(run, flavor, chunks, optimizer, 0)
    return {"before": before, "after": [group["step"] for group in inner.state_dict()["optimizer"]["param_groups"]]}


@pytest.mark.multiproc
def test_a_checkpoint_before_the_first_step_records_step_0():
    """megatron reads torch's Adam's per-parameter ``step`` to save the iteration; before training there is
    none (megatron fills the moments alone to shape the checkpoint). Step 0 is what was taken, of the type
    megatron's own reading gives once there are steps (a state dict before a save equals the loaded one's)."""
    steps = run_ranks(1, steps_in_a_checkpoint_before_training, None)[0]
    assert steps["before"] and set(steps["before"]) == {0} and set(steps["after"]) == {1}
    assert {type(s) for s in steps["before"]} == {type(s) for s in steps["after"]}


def load_fused_adam_layout(group_step) -> dict:
    """In a rank: moments as Transformer Engine's or apex's Adam saves them (``step`` per param group, if
    anywhere, not per parameter), loaded into the torch Adam megatron builds here, then one step."""
    from scripts.train_tiny_gpt import train_step

    run = Run(distributed_optimizer=False, steps=1)
    flavor, _, chunks, optimizer = setup(run)
    saved = optimizer.state_dict()
    inner = saved["optimizer"] if "optimizer" in saved else saved
    for group in inner["param_groups"]:
        if group_step is not None:
            group["step"] = group_step
    params = [p for group in optimizer.optimizer.param_groups for p in group["params"]]
    for param, index in zip(params, [i for g in inner["param_groups"] for i in g["params"]]):
        inner["state"][index] = {"exp_avg": torch.zeros_like(param), "exp_avg_sq": torch.zeros_like(param)}
    optimizer.load_state_dict(saved)
    loaded = {float(optimizer.optimizer.state[p]["step"]) for p in params}
    train_step(run, flavor, chunks, optimizer, 0)
    return {"loaded": loaded, "after_a_step": {float(optimizer.optimizer.state[p]["step"]) for p in params}}


@pytest.mark.multiproc
@pytest.mark.parametrize("group_step, want", [(None, 0.0), (7, 7.0)], ids=["never-stepped", "group-step"])
def test_moments_saved_without_per_parameter_steps_load_into_torch_adam(group_step, want):
    result = run_ranks(1, load_fused_adam_layout, group_step)[0]
    assert result == {"loaded": {want}, "after_a_step": {want + 1}}

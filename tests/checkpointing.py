"""Save and load the tiny GPT with dist_checkpointing under model parallelism (a rank function)."""

import dataclasses

import torch
from megatron.core import dist_checkpointing

from scripts.train_tiny_gpt import Run, build, finish, setup, train_step


def _sharded_state(chunks, optimizer, sharding: str, is_loading: bool = False):
    """``sharding``: the distributed optimizer's format, dp_reshardable (Megatron-LM's default) or
    fully_reshardable (loadable at another layout). 0.16.1's own default cannot be saved at all."""
    model = chunks[0].module if hasattr(chunks[0], "module") else chunks[0]
    model_state = model.sharded_state_dict()
    metadata = {"distrib_optim_sharding_type": sharding}
    return {"model": model_state,
            "optimizer": optimizer.sharded_state_dict(model_state, is_loading=is_loading,
                                                      metadata=metadata)}


def _snapshot(chunks, optimizer) -> dict:
    params = {name: p.detach().clone() for name, p in chunks[0].named_parameters()}
    # The torch optimizers inside megatron's wrappers hold Adam's moments and steps.
    inner = [opt.optimizer.state_dict()["state"]
             for opt in getattr(optimizer, "chained_optimizers", [optimizer])]
    return {"params": params, "optimizer": _clone_tensors(inner)}


def _clone_tensors(value):
    if torch.is_tensor(value):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone_tensors(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_clone_tensors(v) for v in value)
    return value


def checkpoint_round_trip(run: Run, directory: str, sharding: str) -> dict:
    """Train a few steps, save with dist_checkpointing, load into a freshly seeded model+optimizer.

    Returns whether every parameter and optimizer tensor came back bit-exact, and the loss of one more
    step from the original and from the restored state."""
    flavor, _, chunks, optimizer = setup(run)
    for step in range(run.steps):
        train_step(run, flavor, chunks, optimizer, step)
    saved = _snapshot(chunks, optimizer)
    dist_checkpointing.save(_sharded_state(chunks, optimizer, sharding), directory)
    torch.distributed.barrier()

    # A second model and optimizer from another seed, then the checkpoint loaded into them.
    _, _, fresh_chunks, fresh_optimizer = build(dataclasses.replace(run, seed=run.seed + 1))
    differs_before = any(not torch.equal(p, saved["params"][n])
                         for n, p in fresh_chunks[0].named_parameters())
    state = dist_checkpointing.load(
        _sharded_state(fresh_chunks, fresh_optimizer, sharding, is_loading=True), directory)
    model = fresh_chunks[0].module
    model.load_state_dict(state["model"])
    with torch.no_grad():  # fp32 main params are views of the leaf params (megatron's dp_reshardable
        fresh_optimizer.load_state_dict(state["optimizer"])  # loader copies into them in place)
    loaded = _snapshot(fresh_chunks, fresh_optimizer)

    params_equal = all(torch.equal(loaded["params"][n], t) for n, t in saved["params"].items())
    optimizer_equal = _tensors_equal(saved["optimizer"], loaded["optimizer"])
    next_loss_original, _ = train_step(run, flavor, chunks, optimizer, run.steps)
    next_loss_restored, _ = train_step(run, flavor, fresh_chunks, fresh_optimizer, run.steps)
    finish()
    return {"differs_before": differs_before, "params_equal": params_equal,
            "optimizer_equal": optimizer_equal, "n_params": len(saved["params"]),
            "next_loss": (next_loss_original, next_loss_restored)}


def _tensors_equal(a, b) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(
            _tensors_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_tensors_equal(x, y) for x, y in zip(a, b))
    return a == b

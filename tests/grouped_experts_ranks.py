"""Rank functions of the grouped experts' multi-rank tests (tests/test_moe_parallel.py): their checkpoint layout
at EP x expert-TP against megatron's own SequentialMLP, and megatron's optimizers' checkpoints of them."""

from __future__ import annotations

import dataclasses

import adapter
import torch
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from scripts.train_tiny_gpt import finish, train_step
from tests.checkpointing import _sharded_state, _snapshot, _tensors_equal
from tests.moe_ranks import MoeRun, _distributed, build, setup
from tests.test_moe_kernels import _both_expert_layers, _experts_config


def _layout(experts) -> list[tuple]:
    """Every sharded tensor this rank saves, as the checkpoint sees it: key, the piece's shape, where it lies
    in which whole, and which replica it is."""
    sharded = experts.sharded_state_dict(prefix="mlp.")
    apply_factories(sharded)
    return sorted((t.key, tuple(t.local_shape), tuple(t.global_shape), tuple(t.global_offset), t.replica_id)
                  for t in nested_values(sharded) if isinstance(t, ShardedTensor))


def sharded_layouts(tp: int, ep: int) -> dict:
    """This rank's checkpoint layout of the grouped experts and of megatron's SequentialMLP (biased, gated)
    at TP ``tp`` (expert TP too) x EP ``ep``."""
    adapter.init_distributed()
    parallel_state.initialize_model_parallel(tp, 1, expert_model_parallel_size=ep)
    model_parallel_cuda_manual_seed(1)
    config = dataclasses.replace(_experts_config(bias=True), tensor_model_parallel_size=tp,
                                 expert_model_parallel_size=ep)
    grouped, sequential = _both_expert_layers(config)
    layouts = {"grouped": _layout(grouped), "sequential": _layout(sequential)}
    parallel_state.destroy_model_parallel()
    finish()
    return layouts


def optimizer_round_trip(moe: MoeRun, directory: str, sharding: str) -> dict:
    """Train ``moe`` two steps, save model and distributed optimizer in ``sharding``, load both into a model
    and optimizer built from another seed on the same layout: whether every parameter and every optimizer
    tensor came back bit-exact, and whether they differed before."""
    flavor, config, chunk, optimizer = setup(moe)
    for step in range(2):
        train_step(moe.run, flavor, [chunk], optimizer, step)
    saved = _snapshot([chunk], optimizer)
    dist_checkpointing.save(_sharded_state([chunk], optimizer, sharding), directory)
    torch.distributed.barrier()
    fresh_config, fresh_model = build(dataclasses.replace(moe, run=dataclasses.replace(moe.run, seed=moe.run.seed + 1)),
                                      moe.run.tp, moe.ep)
    fresh_chunk, fresh_optimizer = _distributed(fresh_config, fresh_model, moe.run)
    differs_before = any(not torch.equal(p, saved["params"][n]) for n, p in fresh_chunk.named_parameters())
    state = dist_checkpointing.load(_sharded_state([fresh_chunk], fresh_optimizer, sharding, is_loading=True),
                                    directory)
    fresh_chunk.module.load_state_dict(state["model"])
    with torch.no_grad():  # fp32 main params are views of the leaf params (dp_reshardable copies in place)
        fresh_optimizer.load_state_dict(state["optimizer"])
    loaded = _snapshot([fresh_chunk], fresh_optimizer)
    expert_params = sorted(n for n in saved["params"] if ".experts." in n)
    result = {"differs_before": differs_before, "expert_params": expert_params,
              "params_equal": all(torch.equal(loaded["params"][n], t) for n, t in saved["params"].items()),
              "optimizer_equal": _tensors_equal(saved["optimizer"], loaded["optimizer"])}
    parallel_state.destroy_model_parallel()
    finish()
    return result

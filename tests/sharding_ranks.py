"""Rank functions of the sharding tests: megatron-core's tiny GPT (scripts/train_tiny_gpt.py's model, data and
train step) wrapped in megatron's FullyShardedDataParallel (Megatron-FSDP, ``optim_grads_params``) or in DDP
with the distributed optimizer, the reference; each rank reports its losses and the bytes it holds."""

from __future__ import annotations

import adapter
import torch
from adapter import kernels
import torch.distributed.checkpoint
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import preprocess_state_dict_for_uneven_dtensor
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

import models
from models.provider import build_model, transformer_config
from scripts.train_tiny_gpt import Run, finish, train_step


def _local_bytes(tensor) -> int:
    """The bytes this rank holds of ``tensor`` (a DTensor's local shard)."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def _buffer_bytes(buffers) -> int:
    return sum(b.data.numel() * b.data.element_size() for b in buffers if b is not None and b.data is not None)


def _held_bytes(chunk, optimizer) -> dict:
    """Bytes this rank keeps between steps: Megatron-FSDP's persistent buffers (sharded by its strategy),
    DDP's whole parameters and gradient buffers; the optimizer's state tensors, this rank's part of them."""
    if hasattr(chunk.module, "param_and_grad_buffer"):
        groups = chunk.module.param_and_grad_buffer.parameter_groups
        params = _buffer_bytes(g.model_weight_buffer for g in groups)
        grads = _buffer_bytes(g.main_grad_buffer for g in groups)
    else:
        params = sum(_local_bytes(p) for p in chunk.module.parameters())
        grads = sum(b.grad_data.numel() * b.grad_data.element_size() for b in chunk.buffers)
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    states = [t for opt in inner for state in opt.optimizer.state.values() for t in state.values()
              if torch.is_tensor(t) and t.dim() > 0]
    return {"param_bytes": params, "grad_bytes": grads, "optimizer_bytes": sum(_local_bytes(t) for t in states)}


def _build(run: Run, sharded: bool):
    """Seeded tiny GPT at TP ``run.tp``: in Megatron-FSDP if ``sharded``, else in DDP; its optimizer."""
    adapter.init_distributed()
    parallel_state.initialize_model_parallel(run.tp, 1)
    torch.manual_seed(run.seed)
    model_parallel_cuda_manual_seed(run.seed)
    flavor = models.get(run.flavor)
    config = transformer_config(flavor)
    model = build_model(flavor, config)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=True, use_distributed_optimizer=True,
        bucket_size=run.bucket_size, use_megatron_fsdp=sharded,
        data_parallel_sharding_strategy="optim_grads_params" if sharded else "no_shard")
    wrapper = FullyShardedDataParallel if sharded else DistributedDataParallel
    chunk = wrapper(config, ddp_config, model)
    config.no_sync_func = chunk.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=run.lr, weight_decay=0.01, clip_grad=1.0,
                        use_distributed_optimizer=True), [chunk])
    config.grad_scale_func = optimizer.scale_loss
    return flavor, chunk, optimizer


def train(run: Run, sharded: bool) -> dict:
    """``run.steps`` iterations at TP ``run.tp``; Megatron-FSDP if ``sharded``, else DDP + distributed optimizer."""
    flavor, chunk, optimizer = _build(run, sharded)
    losses = [train_step(run, flavor, [chunk], optimizer, step)[0] for step in range(run.steps)]
    result = {"losses": losses, **_held_bytes(chunk, optimizer)}
    finish()
    return result


def _fsdp_dtensor_state(chunk, optimizer, is_loading: bool) -> dict:
    """The state dict Megatron-LM's fsdp_dtensor format saves and loads: the model's DTensors, the optimizer's
    (one DTensor per parameter state), prepared for uneven shards by megatron_fsdp."""
    state = {"model": chunk.state_dict_for_save_checkpoint()}
    metadata = {"distrib_optim_sharding_type": "fsdp_dtensor", "singleton_local_shards": False,
                "chained_optim_avoid_prefix": True,
                "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading, metadata=metadata)
    return preprocess_state_dict_for_uneven_dtensor(state)


def train_from_checkpoint(run: Run, directory: str, start: int, stop: int) -> dict:
    """Megatron-FSDP iterations ``start + 1 .. stop``, as Megatron-LM runs its fsdp_dtensor checkpoint: loaded
    from ``directory`` first where ``start`` > 0, saved there at ``stop`` (torch's distributed checkpoint).
    Returns {iteration: loss} and the kernel provider that ran them."""
    flavor, chunk, optimizer = _build(run, True)
    if start:
        state = _fsdp_dtensor_state(chunk, optimizer, is_loading=True)
        torch.distributed.checkpoint.load(state, checkpoint_id=directory)
        chunk.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    losses = {step + 1: train_step(run, flavor, [chunk], optimizer, step)[0] for step in range(start, stop)}
    torch.distributed.checkpoint.save(_fsdp_dtensor_state(chunk, optimizer, is_loading=False), checkpoint_id=directory)
    finish()
    return {"losses": losses, "kernels": kernels.current().__name__.rpartition(".")[2]}

"""Rank functions of the sharding tests: megatron-core's tiny GPT (scripts/train_tiny_gpt.py's model, data and
train step) wrapped in megatron's FullyShardedDataParallel (Megatron-FSDP, ``optim_grads_params``), in its
TorchFullyShardedDataParallel (torch FSDP2), or in DDP with the distributed optimizer, the reference; each rank
reports its losses and the bytes it holds."""

from __future__ import annotations

import argparse

import adapter
import torch
import torch.distributed.checkpoint
from adapter import kernels
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import preprocess_state_dict_for_uneven_dtensor
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

import models
from adapter import sharding
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
    return {"param_bytes": params, "grad_bytes": grads, "optimizer_bytes": _optimizer_bytes(optimizer)}


def _optimizer_bytes(optimizer) -> int:
    """This rank's part of the optimizer's state tensors (local shards where they are DTensors)."""
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    states = [t for opt in inner for state in opt.optimizer.state.values() for t in state.values()
              if torch.is_tensor(t) and t.dim() > 0]
    return sum(_local_bytes(t) for t in states)


def _build(run: Run, sharded: bool):
    """Seeded tiny GPT at TP ``run.tp``: in Megatron-FSDP if ``sharded``, else in DDP; its optimizer."""
    adapter.init_distributed()
    parallel_state.initialize_model_parallel(run.tp, 1)
    return _wrapped(run, sharded, run.seed)


def _wrapped(run: Run, sharded: bool, seed: int):
    """The tiny GPT of ``seed`` (on the groups that exist) wrapped as ``_build`` says; its optimizer."""
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
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


def _megatron_lm_fsdp_dtensor_state(chunk, optimizer, is_loading: bool) -> tuple[dict, dict]:
    """Megatron-LM's fsdp_dtensor state dict of a ``--swiglu`` model, as its checkpointing prepares it
    (``preprocess_fsdp_dtensor_state_dict``, handed the model ``unwrap_model`` leaves): each ``linear_fc1``
    split into gate and up halves, views of the model's and optimizer's tensors. Returns it and the unsplit
    state (what Megatron-LM hands ``load_state_dict`` after loading into the split one)."""
    from megatron.core.utils import unwrap_model
    from megatron.training.checkpointing import preprocess_fsdp_dtensor_state_dict

    raw = {"model": chunk.state_dict_for_save_checkpoint()}
    metadata = {"distrib_optim_sharding_type": "fsdp_dtensor", "singleton_local_shards": False,
                "chained_optim_avoid_prefix": True,
                "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    raw["optimizer"] = optimizer.sharded_state_dict(raw, is_loading=is_loading, metadata=metadata)
    args = argparse.Namespace(swiglu=True, num_experts=None)
    return preprocess_fsdp_dtensor_state_dict(args, raw, unwrap_model([chunk])[0]), dict(raw)


def swiglu_split_resume(run: Run, directory: str, at: int) -> dict:
    """Megatron-FSDP trains ``run.steps`` iterations, saving Megatron-LM's fsdp_dtensor checkpoint of its
    SwiGLU model after ``at``; a model and optimizer of another seed load it as Megatron-LM does (into the
    split state, then ``load_state_dict`` of the unsplit one) and train on. Returns both runs' losses after
    ``at`` and the model keys of the checkpoint's ``linear_fc1``."""
    flavor, chunk, optimizer = _build(run, True)
    losses = []
    for step in range(run.steps):
        losses.append(train_step(run, flavor, [chunk], optimizer, step)[0])
        if step + 1 == at:
            torch.distributed.checkpoint.save(_megatron_lm_fsdp_dtensor_state(chunk, optimizer, False)[0],
                                              checkpoint_id=directory)
    _, fresh, fresh_optimizer = _wrapped(run, True, run.seed + 1)
    split, raw = _megatron_lm_fsdp_dtensor_state(fresh, fresh_optimizer, True)
    torch.distributed.checkpoint.load(split, checkpoint_id=directory)
    fresh.load_state_dict(raw["model"])
    fresh_optimizer.load_state_dict(raw["optimizer"])
    resumed = [train_step(run, flavor, [fresh], fresh_optimizer, step)[0] for step in range(at, run.steps)]
    finish()
    metadata = torch.distributed.checkpoint.FileSystemReader(directory).read_metadata().state_dict_metadata
    return {"uninterrupted": losses[at:], "resumed": resumed,
            "fc1_keys": sorted(k for k in metadata if k.startswith("model.") and ".0.mlp.linear_fc1." in k)}


def _fsdp2_bytes(chunk, optimizer) -> dict:
    """Bytes this rank keeps between steps under torch FSDP2: each parameter's and gradient's local shard
    (DTensors, resharded after backward) and the optimizer's state (DTensors like the parameters)."""
    params = list(chunk.module.parameters())
    return {"param_bytes": sum(_local_bytes(p) for p in params),
            "grad_bytes": sum(_local_bytes(p.grad) for p in params if p.grad is not None),
            "optimizer_bytes": _optimizer_bytes(optimizer)}


def _build_fsdp2(run: Run, seed: int, bf16: bool = False):
    """The tiny GPT wrapped in megatron's TorchFullyShardedDataParallel (torch's fully_shard over the DP
    group) with megatron's optimizer without the distributed one, as Megatron-LM runs ``--use-torch-fsdp2``
    (it refuses the distributed optimizer with it), on the groups that exist; in ``bf16`` as ``--bf16``:
    Float16Module inside, megatron's mixed-precision optimizer with fp32 main parameters."""
    from megatron.core.distributed import TorchFullyShardedDataParallel, TorchFullyShardedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    flavor = models.get(run.flavor)
    # the spec build_model uses; megatron's wrapper then shards whole layers, not their ColumnParallelLinears
    config = transformer_config(flavor, transformer_impl="local", bf16=bf16)
    model = Float16Module(config, build_model(flavor, config)) if bf16 else build_model(flavor, config)
    chunk = TorchFullyShardedDataParallel(config, TorchFullyShardedDataParallelConfig(), model)
    config.no_sync_func = chunk.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=run.lr, weight_decay=0.01, clip_grad=1.0, bf16=bf16), [chunk])
    config.grad_scale_func = optimizer.scale_loss
    return flavor, chunk, optimizer


def train_fsdp2(run: Run) -> dict:
    """``run.steps`` iterations at TP ``run.tp`` under torch FSDP2 through megatron."""
    adapter.init_distributed()
    parallel_state.initialize_model_parallel(run.tp, 1)
    flavor, chunk, optimizer = _build_fsdp2(run, run.seed)
    losses = [train_step(run, flavor, [chunk], optimizer, step)[0] for step in range(run.steps)]
    result = {"losses": losses, **_fsdp2_bytes(chunk, optimizer)}
    finish()
    return result


def _fsdp2_state(chunk, optimizer, is_loading: bool = False) -> dict:
    model = chunk.sharded_state_dict()
    return {"model": model, "optimizer": optimizer.sharded_state_dict(model, is_loading=is_loading)}


def fsdp2_resume(run: Run, directory: str, at: int, bf16: bool = False) -> dict:
    """Megatron-LM's torch_dist path for FSDP2 through megatron-core: train ``run.steps`` iterations saving
    model and optimizer after ``at``; a model and optimizer of another seed then load that checkpoint in
    place (as Megatron-LM's ``load_checkpoint`` does with FSDP2), get the saved step back, and train on.
    Returns the losses after ``at`` of both."""
    adapter.init_distributed()
    parallel_state.initialize_model_parallel(run.tp, 1)
    flavor, chunk, optimizer = _build_fsdp2(run, run.seed, bf16)
    losses = []
    for step in range(run.steps):
        losses.append(train_step(run, flavor, [chunk], optimizer, step)[0])
        if step + 1 == at:
            dist_checkpointing.save(_fsdp2_state(chunk, optimizer), directory)
    _, fresh, fresh_optimizer = _build_fsdp2(run, run.seed + 1, bf16)
    dist_checkpointing.load(_fsdp2_state(fresh, fresh_optimizer, is_loading=True), directory)
    sharding.restore_saved_step(directory, fresh_optimizer)
    resumed = [train_step(run, flavor, [fresh], fresh_optimizer, step)[0] for step in range(at, run.steps)]
    finish()
    return {"uninterrupted": losses[at:], "resumed": resumed}

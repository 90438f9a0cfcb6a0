"""Rank function of the optimizer-offload tests: megatron-core's tiny GPT (scripts/train_tiny_gpt.py's model,
data and train step) in DDP with the distributed optimizer, its optimizer built by megatron's
``get_megatron_optimizer`` with ``optimizer_cpu_offload`` (megatron's HybridDeviceOptimizer) or without it (the
reference); each rank reports its losses and where its optimizer state lives.

In bf16, as Megatron-LM's recipes train with offloading: the distributed optimizer hands megatron's
HybridDeviceOptimizer fp32 parameters as views of the model's (not leaves), which torch's optimizer refuses
on every device; bf16 parameters reach it as detached shards with fp32 main copies kept by it."""

from __future__ import annotations

import adapter
import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.module import Float16Module

import models
from adapter import host_memory
from models.provider import build_model, transformer_config
from scripts.train_tiny_gpt import Run, finish, train_step


def state_bytes(optimizer) -> dict:
    """Bytes of this rank's optimizer state, Adam's moments and the fp32 main parameters (the plain distributed
    optimizer holds those as its parameters, megatron's HybridDeviceOptimizer in its state), on the device and
    in host memory, sorted as an accelerator sorts them (``adapter.host_memory.is_host``)."""
    tensors = {}
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in opt.optimizer.state.values():
            tensors.update((id(t), t) for t in state.values() if torch.is_tensor(t) and t.dim() > 0)
        for group in opt.optimizer.param_groups:
            tensors.update((id(p), p) for p in group["params"] if p.dtype == torch.float32)
    host = sum(t.numel() * t.element_size() for t in tensors.values() if host_memory.is_host(t))
    device = sum(t.numel() * t.element_size() for t in tensors.values() if not host_memory.is_host(t))
    return {"device_state_bytes": device, "host_state_bytes": host}


def train(run: Run, offload_fraction: float | None) -> dict:
    """``run.steps`` iterations at TP ``run.tp``; the optimizer offloads ``offload_fraction`` of its state to
    host memory (megatron's HybridDeviceOptimizer), or is the plain distributed optimizer if None."""
    adapter.init_distributed()
    parallel_state.initialize_model_parallel(run.tp, 1)
    torch.manual_seed(run.seed)
    model_parallel_cuda_manual_seed(run.seed)
    flavor = models.get(run.flavor)
    config = transformer_config(flavor, bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=True,
                                               use_distributed_optimizer=True, bucket_size=run.bucket_size)
    chunk = DistributedDataParallel(config, ddp_config, Float16Module(config, build_model(flavor, config)))
    config.no_sync_func = chunk.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    offload = {} if offload_fraction is None else dict(
        optimizer_cpu_offload=True, use_precision_aware_optimizer=True, optimizer_offload_fraction=offload_fraction)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=run.lr, weight_decay=0.01, clip_grad=1.0, bf16=True,
                        use_distributed_optimizer=True, **offload), [chunk])
    config.grad_scale_func = optimizer.scale_loss
    losses = [train_step(run, flavor, [chunk], optimizer, step)[0] for step in range(run.steps)]
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    result = {"losses": losses, **state_bytes(optimizer),
              "hybrid": all(isinstance(opt.optimizer, HybridDeviceOptimizer) for opt in inner)}
    finish()
    return result

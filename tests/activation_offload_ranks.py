"""Rank function of the fine-grained activation offloading tests: megatron-core's tiny GPT (scripts/train_tiny_gpt.py's
model, data and train step) in DDP with the distributed optimizer, with megatron's activation offloading of the
given modules' inputs or without it (the reference); each rank reports its losses and the bytes megatron's
offload manager says it offloaded."""

from __future__ import annotations

import adapter
import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel.fine_grained_activation_offload import PipelineOffloadManager
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

import models
from models.provider import build_model, transformer_config
from scripts.train_tiny_gpt import Run, finish, train_step


def train(run: Run, offload_modules: list[str] | None) -> dict:
    """``run.steps`` iterations at TP ``run.tp``, offloading the inputs of ``offload_modules`` (every size), or
    nothing if None."""
    adapter.init_distributed()
    parallel_state.initialize_model_parallel(run.tp, 1)
    torch.manual_seed(run.seed)
    model_parallel_cuda_manual_seed(run.seed)
    flavor = models.get(run.flavor)
    offload = {} if offload_modules is None else dict(
        fine_grained_activation_offloading=True, offload_modules=offload_modules, min_offloaded_tensor_size=0)
    config = transformer_config(flavor, **offload)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=True,
                                               use_distributed_optimizer=True, bucket_size=run.bucket_size)
    chunk = DistributedDataParallel(config, ddp_config, build_model(flavor, config))
    config.no_sync_func = chunk.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=run.lr, weight_decay=0.01, clip_grad=1.0,
                        use_distributed_optimizer=True), [chunk])
    config.grad_scale_func = optimizer.scale_loss
    losses = [train_step(run, flavor, [chunk], optimizer, step)[0] for step in range(run.steps)]
    offloaded = 0 if offload_modules is None else PipelineOffloadManager.get_instance().offload_summary_total_bytes
    result = {"losses": losses, "offloaded_bytes": offloaded}
    finish()
    return result

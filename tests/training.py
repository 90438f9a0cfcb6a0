"""Rank functions that train the tiny GPT through megatron-core's own machinery on the adapter.

Everything here is megatron-core as a user would write it (DDP, get_megatron_optimizer, the pipeline
schedules, finalize_model_grads, dist_checkpointing); only ``import adapter`` comes first. The tests
launch these with tests.distributed.run_ranks.
"""

from __future__ import annotations

import dataclasses
import functools

import adapter  # noqa: F401  - before megatron, as users do
import torch
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from models.gpt import FLAVORS, build_gpt, transformer_config


@dataclasses.dataclass(frozen=True)
class Run:
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    distributed_optimizer: bool = False
    ddp: bool = True
    steps: int = 10
    micro_batch: int = 2
    global_batch: int = 8
    lr: float = 1e-3
    dropout: float = 0.0
    seed: int = 1234
    flavor: str = "tiny"


def setup(run: Run):
    """Groups, seeds, model chunks (DDP-wrapped) and optimizer for ``run``."""
    adapter.init_distributed()
    parallel_state.initialize_model_parallel(run.tp, run.pp, run.vpp)
    torch.manual_seed(run.seed)
    model_parallel_cuda_manual_seed(run.seed)
    flavor = FLAVORS[run.flavor]
    config = transformer_config(flavor, hidden_dropout=run.dropout, attention_dropout=run.dropout)
    stages = [None] if run.vpp is None else list(range(run.vpp))
    chunks = [build_gpt(flavor, config, vp_stage=stage) for stage in stages]
    if run.ddp:
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=True,
            use_distributed_optimizer=run.distributed_optimizer, bucket_size=4096)
        chunks = [DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=i > 0)
                  for i, chunk in enumerate(chunks)]
        config.no_sync_func = [chunk.no_sync for chunk in chunks]
        if len(chunks) == 1:
            config.no_sync_func = config.no_sync_func[0]
        config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=run.lr, weight_decay=0.01, clip_grad=1.0,
                        use_distributed_optimizer=run.distributed_optimizer),
        chunks)
    config.grad_scale_func = optimizer.scale_loss
    return flavor, config, chunks, optimizer


def batches(run: Run, flavor, step: int):
    """This data-parallel rank's micro-batches of step ``step``: the same global batch on any layout."""
    generator = torch.Generator().manual_seed(10_000 + step)
    # Counting sequences from random starts: learnable, so a working step shows as a falling loss.
    starts = torch.randint(0, flavor.vocab_size, (run.global_batch, 1), generator=generator)
    samples = (starts + torch.arange(flavor.seq_length + 1)) % flavor.vocab_size
    dp = parallel_state.get_data_parallel_world_size()
    per_rank = run.global_batch // dp
    mine = samples.split(per_rank)[parallel_state.get_data_parallel_rank()]
    return [{"tokens": mb[:, :-1].contiguous(), "labels": mb[:, 1:].contiguous()}
            for mb in mine.split(run.micro_batch)]


def _loss(loss_mask, output):
    loss = (output.float() * loss_mask).sum() / loss_mask.sum()
    return loss, {"lm loss": loss.detach().clone()}  # the schedule divides loss in place


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    tokens, labels = batch["tokens"], batch["labels"]
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    output = model(tokens, positions, None, labels=labels)
    return output, functools.partial(_loss, torch.ones_like(labels, dtype=torch.float32))


def train_step(run: Run, flavor, chunks, optimizer, step: int):
    """One iteration; returns the global-batch mean loss (on the last stage, else None) and grad norm."""
    microbatches = batches(run, flavor, step)
    for chunk in chunks:
        if run.ddp:
            chunk.zero_grad_buffer()
    optimizer.zero_grad()
    iterators = [iter(microbatches) for _ in chunks]
    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=len(microbatches), seq_length=flavor.seq_length,
        micro_batch_size=run.micro_batch, forward_only=False)
    _, grad_norm, _ = optimizer.step()
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return None, grad_norm
    mean = torch.stack([entry["lm loss"] for entry in losses]).mean()
    torch.distributed.all_reduce(mean, group=parallel_state.get_data_parallel_group())
    return (mean / parallel_state.get_data_parallel_world_size()).item(), grad_norm


def optimizer_state_bytes(optimizer) -> int:
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    return sum(t.numel() * t.element_size()
               for opt in inner for state in opt.optimizer.state.values()
               for t in state.values() if torch.is_tensor(t) and t.dim() > 0)


def train(run: Run) -> dict:
    """Train ``run.steps`` iterations; this rank's losses, grad norms and optimizer-state bytes."""
    flavor, _, chunks, optimizer = setup(run)
    losses, norms = [], []
    for step in range(run.steps):
        loss, norm = train_step(run, flavor, chunks, optimizer, step)
        losses.append(loss)
        norms.append(norm)
    return {"rank": torch.distributed.get_rank(), "losses": losses, "grad_norms": norms,
            "optimizer_state_bytes": optimizer_state_bytes(optimizer),
            "dp_size": parallel_state.get_data_parallel_world_size()}


def _sharded_state(chunks, optimizer, is_loading: bool = False):
    model = chunks[0].module if hasattr(chunks[0], "module") else chunks[0]
    model_state = model.sharded_state_dict()
    # The format that can be loaded at another TP/PP/DP (the default in 0.16.1 cannot be saved at all).
    metadata = {"distrib_optim_sharding_type": "fully_reshardable"}
    return {"model": model_state,
            "optimizer": optimizer.sharded_state_dict(model_state, is_loading=is_loading,
                                                      metadata=metadata)}


def _snapshot(chunks, optimizer) -> dict:
    params = {name: p.detach().clone() for name, p in chunks[0].named_parameters()}
    # The torch optimizers inside megatron's wrappers hold Adam's moments and steps.
    inner = [opt.optimizer.state_dict() for opt in getattr(optimizer, "chained_optimizers", [optimizer])]
    return {"params": params, "optimizer": _clone_tensors(inner)}


def _clone_tensors(value):
    if torch.is_tensor(value):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone_tensors(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_clone_tensors(v) for v in value)
    return value


def checkpoint_round_trip(run: Run, directory: str) -> dict:
    """Train a few steps, save with dist_checkpointing, load into a freshly seeded model+optimizer.

    Returns whether every parameter and optimizer tensor came back bit-exact, and the loss of one more
    step from the original and from the restored state."""
    flavor, _, chunks, optimizer = setup(run)
    for step in range(run.steps):
        train_step(run, flavor, chunks, optimizer, step)
    saved = _snapshot(chunks, optimizer)
    dist_checkpointing.save(_sharded_state(chunks, optimizer), directory)
    torch.distributed.barrier()

    # A second model and optimizer from another seed, then the checkpoint loaded into them.
    torch.manual_seed(run.seed + 1)
    model_parallel_cuda_manual_seed(run.seed + 1)
    other = dataclasses.replace(run, seed=run.seed + 1)
    _, _, fresh_chunks, fresh_optimizer = _fresh(other)
    train_step(other, flavor, fresh_chunks, fresh_optimizer, 0)  # creates optimizer state to load into
    differs_before = any(not torch.equal(p, saved["params"][n])
                         for n, p in fresh_chunks[0].named_parameters())
    state = dist_checkpointing.load(_sharded_state(fresh_chunks, fresh_optimizer, is_loading=True),
                                   directory)
    model = fresh_chunks[0].module
    model.load_state_dict(state["model"])
    fresh_optimizer.load_state_dict(state["optimizer"])
    loaded = _snapshot(fresh_chunks, fresh_optimizer)

    params_equal = all(torch.equal(loaded["params"][n], t) for n, t in saved["params"].items())
    optimizer_equal = _tensors_equal(saved["optimizer"], loaded["optimizer"])
    next_loss_original, _ = train_step(run, flavor, chunks, optimizer, run.steps)
    next_loss_restored, _ = train_step(run, flavor, fresh_chunks, fresh_optimizer, run.steps)
    return {"differs_before": differs_before, "params_equal": params_equal,
            "optimizer_equal": optimizer_equal, "n_params": len(saved["params"]),
            "next_loss": (next_loss_original, next_loss_restored)}


def _fresh(run: Run):
    """Model and optimizer for ``run`` on the groups that already exist."""
    flavor = FLAVORS[run.flavor]
    config = transformer_config(flavor)
    chunk = build_gpt(flavor, config)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=True,
        use_distributed_optimizer=run.distributed_optimizer, bucket_size=4096)
    chunks = [DistributedDataParallel(config, ddp_config, chunk)]
    config.no_sync_func = chunks[0].no_sync
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=run.lr, weight_decay=0.01, clip_grad=1.0,
                        use_distributed_optimizer=run.distributed_optimizer), chunks)
    config.grad_scale_func = optimizer.scale_loss
    return flavor, config, chunks, optimizer


def _tensors_equal(a, b) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(
            _tensors_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_tensors_equal(x, y) for x, y in zip(a, b))
    return a == b

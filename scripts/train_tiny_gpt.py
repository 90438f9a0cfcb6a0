"""Train the tiny GPT with plain megatron-core code; ``import adapter`` is the only addition.

    torchrun --nproc_per_node 2 scripts/train_tiny_gpt.py --tp 2
    torchrun --nproc_per_node 4 scripts/train_tiny_gpt.py --tp 2 --pp 2 --distributed-optimizer
    torchrun --nproc_per_node 2 scripts/train_tiny_gpt.py --tp 2 --sequence-parallel

Megatron-core as a user writes it: DDP with overlapped bucketed grad reduction, get_megatron_optimizer,
the (interleaved) pipeline schedules and finalize_model_grads. The same code runs on CPU (gloo), CUDA
(NCCL) and Ascend NPUs (HCCL). The tests train through these functions too.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

import adapter  # noqa: F401  - before megatron, as users do
import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.timers import Timers

import models
from models.provider import build_model, transformer_config


@dataclasses.dataclass(frozen=True)
class Run:
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    distributed_optimizer: bool = False
    ddp: bool = True
    steps: int = 10
    bucket_size: int | None = 4096  # small, so DDP overlaps several buckets
    micro_batch: int = 2
    global_batch: int = 8
    lr: float = 1e-3
    dropout: float = 0.0
    sequence_parallel: bool = False
    seed: int = 1234
    flavor: str = "gpt-tiny"


def setup(run: Run):
    """Groups and seeds for ``run``, then its model chunks and optimizer (see ``build``)."""
    adapter.init_distributed()
    parallel_state.initialize_model_parallel(run.tp, run.pp, run.vpp)
    return build(run)


def build(run: Run):
    """Seeded model chunks (DDP-wrapped) and optimizer for ``run`` on the groups that exist."""
    torch.manual_seed(run.seed)
    model_parallel_cuda_manual_seed(run.seed)
    flavor = models.get(run.flavor)
    config = transformer_config(flavor, hidden_dropout=run.dropout, attention_dropout=run.dropout,
                                sequence_parallel=run.sequence_parallel)
    stages = [None] if run.vpp is None else list(range(run.vpp))
    chunks = [build_model(flavor, config, vp_stage=stage) for stage in stages]
    if run.ddp:
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=True,
            use_distributed_optimizer=run.distributed_optimizer, bucket_size=run.bucket_size)
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


TIMERS = Timers(log_level=1, log_option="minmax")


def train_step(run: Run, flavor, chunks, optimizer, step: int):
    """One iteration; returns the global-batch mean loss (on the last stage, else None) and grad norm."""
    microbatches = batches(run, flavor, step)
    TIMERS("forward-backward", log_level=1).start(barrier=True)
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
    TIMERS("forward-backward").stop()
    TIMERS("optimizer", log_level=1).start(barrier=True)
    _, grad_norm, _ = optimizer.step()
    TIMERS("optimizer").stop()
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return None, grad_norm
    mean = torch.stack([entry["lm loss"] for entry in losses]).mean()
    torch.distributed.all_reduce(mean, group=parallel_state.get_data_parallel_group())
    return (mean / parallel_state.get_data_parallel_world_size()).item(), grad_norm


def step_timings(run: Run) -> str | None:
    """ms per step, (min, max) over all ranks, as Megatron-LM logs it; the string is on rank 0."""
    return TIMERS.get_all_timers_string(["forward-backward", "optimizer"], normalizer=run.steps,
                                        barrier=True)


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
    timings = step_timings(run)
    chunk = chunks[-1].module if run.ddp else chunks[-1]
    holds_embedding = chunk.pre_process or chunk.post_process
    shared = chunk.shared_embedding_or_output_weight() if holds_embedding else None
    result = {"rank": torch.distributed.get_rank(), "losses": losses, "grad_norms": norms,
              "shared_weight": None if shared is None else shared.detach().clone(),
              "timings": timings,
              "optimizer_state_bytes": optimizer_state_bytes(optimizer),
              "dp_size": parallel_state.get_data_parallel_world_size()}
    finish()
    return result


def finish() -> None:
    """Leave together: rank 0 hosts the rendezvous store the others may still be using."""
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    parser.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
    parser.add_argument("--vpp", type=int, default=None, help="virtual pipeline stages per rank")
    parser.add_argument("--distributed-optimizer", action="store_true")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="split norms and dropout along the sequence over the TP group")
    args = parser.parse_args(argv)
    run = Run(tp=args.tp, pp=args.pp, vpp=args.vpp, distributed_optimizer=args.distributed_optimizer,
              steps=args.steps, dropout=args.dropout, sequence_parallel=args.sequence_parallel)
    flavor, _, chunks, optimizer = setup(run)
    reporter = (parallel_state.is_pipeline_last_stage(ignore_virtual=True)
                and parallel_state.get_tensor_model_parallel_rank() == 0
                and parallel_state.get_data_parallel_rank() == 0)
    if torch.distributed.get_rank() == 0:
        print(f"backend {adapter.current_backend().name}: {torch.distributed.get_world_size()} ranks, "
              f"TP {run.tp} PP {run.pp} DP {parallel_state.get_data_parallel_world_size()}", flush=True)
    for step in range(run.steps):
        loss, grad_norm = train_step(run, flavor, chunks, optimizer, step)
        if reporter:
            print(f"step {step + 1:4d} | lm loss {loss:.4f} | grad norm {grad_norm:.3f}", flush=True)
    timings = step_timings(run)
    if torch.distributed.get_rank() == 0:
        print(timings)
    finish()


if __name__ == "__main__":
    main()

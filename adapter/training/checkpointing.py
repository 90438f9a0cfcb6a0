"""Training checkpoints in Megatron-LM's layout and megatron's torch_dist format: model, optimizer, LR
scheduler, RNG states, iteration and consumed samples.

A checkpoint is never lost: every rank writes into ``.iter_XXXXXXX.partial``; once all have, rank 0
publishes it (``models.checkpoint.publish``: an existing copy of the iteration moves aside, the new one
moves in, the tracker is replaced, the old copy goes, each step on disk before the next), so a process
killed at any instant leaves a complete checkpoint to resume from, and the next start puts back what
the kill interrupted (``recover_interrupted_save``). A save that fails on any rank stops every rank
with that error. The model and the distributed
optimizer are saved resharding-capable (``fully_reshardable``), so a run resumes at another TP/PP/DP;
RNG states are per TP/PP rank and are restored only on the layout that saved them (as Megatron-LM does).
"""

from __future__ import annotations

import datetime
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject

from adapter import device
from adapter.own_packages import import_own
from adapter.training.shared_outcome import shared_outcome

mcore_checkpoint = import_own("models.checkpoint")
OPTIMIZER_FORMAT = {"distrib_optim_sharding_type": "fully_reshardable"}


def _rng_state() -> ShardedObject:
    """This rank's random states, one object per (PP, TP) rank, replicated over data parallel."""
    state = {"random": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "device": device.get_rng_state(),
             "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    pp, tp = parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank()
    shape = (parallel_state.get_pipeline_model_parallel_world_size(),
             parallel_state.get_tensor_model_parallel_world_size())
    return ShardedObject("rng_state", [state], shape, (pp, tp), replica_id=parallel_state.get_data_parallel_rank())


def _set_rng_state(states: list) -> None:
    state = states[0]
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    device.set_rng_state(state["device"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _sharded_state(args, model: list, optimizer, scheduler, iteration: int, consumed: dict,
                   is_loading: bool = False, with_optimizer: bool = True, with_rng: bool = True) -> dict:
    state = {"iteration": iteration, "checkpoint_version": mcore_checkpoint.CHECKPOINT_VERSION,
             "consumed_train_samples": consumed["train"], "consumed_valid_samples": consumed["valid"],
             "layout": _layout(args)}
    chunks = [chunk.module if hasattr(chunk, "module") else chunk for chunk in model]
    model_states = [chunk.sharded_state_dict() for chunk in chunks]
    if len(chunks) == 1:
        state["model"] = model_states[0]
    else:
        state.update({f"model{i}": s for i, s in enumerate(model_states)})
    if with_optimizer:  # the optimizer finds each parameter's sharding in the model's, all chunks nested
        every_chunk = {f"model{i}": chunk_state for i, chunk_state in enumerate(model_states)}
        state["optimizer"] = optimizer.sharded_state_dict(every_chunk, is_loading=is_loading,
                                                          metadata=OPTIMIZER_FORMAT)
        state["opt_param_scheduler"] = scheduler.state_dict()
    if with_rng:
        state["rng_state"] = _rng_state()
    return state


def _layout(args) -> dict:
    return {"tp": args.tensor_model_parallel_size, "pp": args.pipeline_model_parallel_size,
            "vpp": args.virtual_pipeline_model_parallel_size, "dp": args.data_parallel_size}


def save_checkpoint(args, iteration: int, model: list, optimizer, scheduler, consumed: dict) -> Path:
    """Write ``<save>/iter_<iteration>`` on every rank, then publish it; returns its path. Any rank's
    failure stops every rank with that error (``shared_outcome``), leaving the published checkpoints as
    they were."""
    final = Path(args.save) / mcore_checkpoint.checkpoint_name(iteration)
    partial, rank = mcore_checkpoint.aside(final, mcore_checkpoint.PARTIAL), torch.distributed.get_rank()
    with shared_outcome(f"saving iteration {iteration} to {args.save}", _timeout(args)):
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)  # left by a run killed while saving
            partial.mkdir(parents=True)
        torch.distributed.barrier()
        state = _sharded_state(args, model, optimizer, scheduler, iteration, consumed,
                               with_optimizer=not args.no_save_optim, with_rng=not args.no_save_rng)
        dist_checkpointing.save(state, str(partial))  # ends once every rank's files are written
        if rank == 0:
            mcore_checkpoint.publish(partial, iteration)
    return final


def recover_interrupted_save(args) -> None:
    """Rank 0 finishes or undoes what a save killed while publishing left in ``--save``, before anything
    is loaded from or saved there."""
    with shared_outcome(f"recovering {args.save}", _timeout(args)):
        if torch.distributed.get_rank() == 0 and Path(args.save).is_dir():
            for line in mcore_checkpoint.recover_interrupted_save(args.save):
                print(f"{args.save}: {line}", flush=True)


def _timeout(args) -> datetime.timedelta:
    return datetime.timedelta(minutes=args.distributed_timeout_minutes)


def load_checkpoint(args, model: list, optimizer, scheduler) -> tuple[int, dict]:
    """Load ``args.load`` (the latest iteration, or a converted release) into model, optimizer and
    scheduler; returns the iteration to continue from and the consumed samples."""
    consumed = {"train": 0, "valid": 0}
    checkpoint = mcore_checkpoint.checkpoint_to_load(args.load)
    if checkpoint is None:
        if torch.distributed.get_rank() == 0:
            print(f"no checkpoint in {args.load}: training from scratch", flush=True)
        return 0, consumed
    common = dist_checkpointing.load_common_state_dict(str(checkpoint))
    release = checkpoint.name == mcore_checkpoint.RELEASE
    weights_only = release or args.finetune
    same_layout = common.get("layout", {}) == {**_layout(args), "dp": common.get("layout", {}).get("dp")}
    with_optimizer = not (weights_only or args.no_load_optim or "opt_param_scheduler" not in common)
    with_rng = not (weights_only or args.no_load_rng) and same_layout
    state = _sharded_state(args, model, optimizer, scheduler, 0, consumed, is_loading=True,
                           with_optimizer=with_optimizer, with_rng=with_rng)
    if weights_only:
        state = {k: v for k, v in state.items() if k == "model" or k.startswith("model")}
    loaded = dist_checkpointing.load(state, str(checkpoint))
    chunks = [chunk.module if hasattr(chunk, "module") else chunk for chunk in model]
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(loaded["model"] if len(chunks) == 1 else loaded[f"model{i}"])
    if with_optimizer:
        with torch.no_grad():  # megatron's loader copies into views of the parameters
            optimizer.load_state_dict(loaded["optimizer"])
        scheduler.load_state_dict(loaded["opt_param_scheduler"])
    if with_rng:
        _set_rng_state(loaded["rng_state"])
    if weights_only:
        return 0, consumed
    consumed = {"train": common["consumed_train_samples"], "valid": common["consumed_valid_samples"]}
    if torch.distributed.get_rank() == 0:
        print(f"loaded {checkpoint} (iteration {common['iteration']}"
              + ("" if same_layout else f", saved at {common.get('layout')}, RNG states not restored") + ")",
              flush=True)
    return common["iteration"], consumed

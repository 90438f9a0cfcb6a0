"""Training checkpoints in Megatron-LM's layout and megatron's torch_dist format: model, optimizer, LR
scheduler, RNG states, iteration and consumed samples.

A checkpoint is never lost: every rank writes into ``.iter_XXXXXXX.partial``; once all have, rank 0
publishes it (``adapter.checkpoint_dir.publish``: an existing copy of the iteration moves aside, the new one
moves in, the tracker is replaced, the old copy goes, each step on disk before the next), so a process
killed at any instant leaves a complete checkpoint to resume from, and the next start puts back what
the kill interrupted (``recover_interrupted_save``). A save that fails on any rank stops every rank
with that error. The model and the distributed
optimizer are saved resharding-capable (``fully_reshardable``), so a run resumes at another TP/PP/DP and,
for a MoE model, another EP / expert TP: each expert is saved under its global index, so any EP finds its
own. RNG states are per TP/PP rank (per DP rank too with EP > 1, where the expert-parallel random stream
differs between data-parallel ranks, beside Megatron-LM's per TP/PP rank) and are restored only on the layout
that saved them (as Megatron-LM does).

What lies beside the tensors is what Megatron-LM writes and reads (``checkpoint_common``: its arguments, the
optimizer's sharding, the RNG states under its names), so a checkpoint moves between Megatron-LM's
pretrain_gpt.py and the flow, either way.

With --use-megatron-fsdp the format is Megatron-FSDP's fsdp_dtensor (``fsdp_checkpoint``), written into the same
``.partial`` directory and published the same way; with --use-torch-fsdp2 it is torch_dist, the model and
optimizer read in place as Megatron-LM reads them for FSDP2.

Across megatron-core releases: a checkpoint saved under 0.16.1 (its common state in common.pt) resumes under
0.19, at its layout or another (tests/test_checkpoint_upgrade.py): 0.19 reads common.pt as its legacy form, and
the optimizer state is saved per parameter, so the 0.18 rework of the gradient buffers does not reach it. One
saved under 0.19 keeps its common state inside the torch_dist files, which 0.16-0.18 cannot read: --load
refuses it before any rank starts (``adapter.checkpoint_dir.readable_here``).

``--async-save`` (Megatron-LM's meaning): megatron's asynchronous torch_dist save. Each rank hands its shards to
a forked writer process and training goes on; once every rank's writer is done (checked each iteration, one
small all-reduce, as Megatron-LM checks), megatron's finalization writes the metadata and rank 0 publishes the
checkpoint as a synchronous save would. The last one is waited for before the run ends.
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
from megatron.core.optimizer.optimizer import param_group_identifier_keys

from adapter import checkpoint_dir, checkpoint_writes, device, earlier_checkpoints, sharding
from adapter.shared_outcome import shared_outcome
from adapter.training import checkpoint_common, fsdp_checkpoint
from adapter.training.arguments import ArgumentError

# with EP > 1 the flow's RNG states, one per (PP, TP, DP) rank, beside Megatron-LM's one per (PP, TP) rank
PER_DATA_PARALLEL_RNG = "rng_state_per_data_parallel_rank"


def _rng_state(per_data_parallel_rank: bool, key: str = "rng_state") -> ShardedObject:
    """This rank's random states: one object per (PP, TP) rank, replicated over data parallel (Megatron-LM's);
    ``per_data_parallel_rank``, one per (PP, TP, DP) rank, as the flow restores them with EP > 1, since the
    tracker's expert-parallel stream differs between the data-parallel ranks that hold different experts."""
    state = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": device.get_rng_state(),
             "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}
    ps = parallel_state
    ranks = [ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()]
    shape = [ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()]
    dp_rank = ps.get_data_parallel_rank(with_context_parallel=True)
    if not per_data_parallel_rank:
        return ShardedObject(key, [state], tuple(shape), tuple(ranks), replica_id=dp_rank)
    shape.append(ps.get_data_parallel_world_size(with_context_parallel=True))
    return ShardedObject(key, [state], tuple(shape), (*ranks, dp_rank), replica_id=0)


def _rng_entries(args, common: dict | None) -> dict:
    """The RNG objects of a save (``common`` None): Megatron-LM's, and with EP > 1 the flow's per data-parallel
    rank beside it (Megatron-LM restores every data-parallel rank from the first's states, the flow each its
    own); of a load from ``common``'s checkpoint, the one this layout restores, as ``rng_state``: from
    Megatron-LM's (no ``layout``) its own, as it restores them. The flow's checkpoints before they held ``args``
    kept the per-rank states under ``rng_state``."""
    per_rank = args.expert_model_parallel_size > 1
    if common is None:
        return {"rng_state": _rng_state(False), **({PER_DATA_PARALLEL_RNG: _rng_state(True, PER_DATA_PARALLEL_RNG)}
                                                   if per_rank else {})}
    if not per_rank or "layout" not in common:
        return {"rng_state": _rng_state(False)}
    return {"rng_state": _rng_state(True, PER_DATA_PARALLEL_RNG if "args" in common else "rng_state")}


def _set_rng_state(states: list) -> None:
    state = earlier_checkpoints.rng_names(states[0])
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    device.set_rng_state(state["cuda_rng_state"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def _sharded_state(args, model: list, optimizer, scheduler, iteration: int, consumed: dict,
                   is_loading: bool = False, with_optimizer: bool = True, with_rng: bool = True,
                   optimizer_format: dict | None = None, common: dict | None = None) -> dict:
    """What a checkpoint holds (Megatron-LM's keys, and the flow's own record of the consumed samples and the
    layout); ``optimizer_format``: how the optimizer's state is sharded (``checkpoint_common.content_metadata``
    for a save, what the checkpoint names for a load); ``common``: the plain state of the checkpoint loaded."""
    state = {"iteration": iteration, "checkpoint_version": checkpoint_dir.CHECKPOINT_VERSION,
             "consumed_train_samples": consumed["train"], "consumed_valid_samples": consumed["valid"],
             "layout": checkpoint_common.layout(args)}
    if not is_loading:  # a load reads them with the plain values, before (_read_common)
        state["args"] = checkpoint_common.saved_args(args, consumed)
    if args.ckpt_format == fsdp_checkpoint.FORMAT:
        rng = _rng_state(args.expert_model_parallel_size > 1) if with_rng else None
        return fsdp_checkpoint.state_dict(state, model, optimizer, scheduler, rng, is_loading, with_optimizer)
    chunks = [chunk.module if hasattr(chunk, "module") else chunk for chunk in model]
    model_states = [chunk.sharded_state_dict() for chunk in chunks]
    if len(chunks) == 1:
        state["model"] = model_states[0]
    else:
        state.update({f"model{i}": s for i, s in enumerate(model_states)})
    if with_optimizer:  # the optimizer finds each parameter's sharding in the model's, all chunks nested
        every_chunk = {f"model{i}": chunk_state for i, chunk_state in enumerate(model_states)}
        state["optimizer"] = optimizer.sharded_state_dict(
            every_chunk, is_loading=is_loading, metadata=optimizer_format or checkpoint_common.content_metadata(args))
        state["opt_param_scheduler"] = scheduler.state_dict()
    if with_rng:
        state.update(_rng_entries(args, common if is_loading else None))
    return state


def _same_rng_layout(common: dict, args) -> bool:
    """Whether the checkpoint's RNG states belong to this layout's ranks: the same TP, PP, VPP, EP and
    expert TP, and with EP > 1 the same DP (``_rng_entries``). A checkpoint from before expert parallelism
    was recorded had EP 1 and expert TP = TP."""
    current, saved = checkpoint_common.layout(args), checkpoint_common.saved_layout(common)
    saved = {"ep": 1, "etp": saved.get("tp"), **saved}
    keys = ("tp", "pp", "vpp", "ep", "etp") + (("dp",) if current["ep"] > 1 else ())
    return all(saved.get(key) == current[key] for key in keys)


def save_checkpoint(args, iteration: int, model: list, optimizer, scheduler, consumed: dict) -> Path:
    """Write ``<save>/iter_<iteration>`` on every rank, then publish it; returns its path. Any rank's
    failure stops every rank with that error (``shared_outcome``), leaving the published checkpoints as
    they were. With --async-save the writing goes on in the background and the publishing waits for it
    (``finalize_async_saves``)."""
    final = Path(args.save) / checkpoint_dir.checkpoint_name(iteration)
    partial, rank = checkpoint_dir.aside(final, checkpoint_dir.PARTIAL), torch.distributed.get_rank()
    with shared_outcome(f"saving iteration {iteration} to {args.save}", _timeout(args)):
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)  # left by a run killed while saving
            partial.mkdir(parents=True)
        torch.distributed.barrier()
        state = _sharded_state(args, model, optimizer, scheduler, iteration, consumed,
                               with_optimizer=not args.no_save_optim, with_rng=not args.no_save_rng)
        if args.async_save:
            _schedule_async_save(state, partial, iteration, args)
            return final
        if args.ckpt_format == fsdp_checkpoint.FORMAT:
            fsdp_checkpoint.save(state, partial, model, args.model_config)
        else:
            with checkpoint_writes.results_in_process():  # synchronous: no Manager process for the results
                # ends once every rank's files are written
                dist_checkpointing.save(state, str(partial), sharded_strategy=_save_strategy(args),
                                        content_metadata=checkpoint_common.content_metadata(args))
        if rank == 0:
            checkpoint_dir.publish(partial, iteration)
    return final


_ASYNC_SAVES = None  # megatron's queue of this process's asynchronous saves, made at the first


def _schedule_async_save(state: dict, partial: Path, iteration: int, args) -> None:
    """Start megatron's asynchronous save of ``state`` into ``partial`` (its "mcore" strategy: a forked writer
    per rank; Megatron-LM 0.19's default, nvidia-resiliency-ext's, is a CUDA library) and queue its
    publication after megatron's own finalization."""
    import inspect

    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    global _ASYNC_SAVES
    if _ASYNC_SAVES is None:
        _ASYNC_SAVES = AsyncCallsQueue()
    # where megatron has several strategies to choose from
    takes_strategy = "async_strategy" in inspect.signature(dist_checkpointing.save).parameters
    strategy = {"async_strategy": "mcore"} if takes_strategy else {}
    request = dist_checkpointing.save(state, str(partial), sharded_strategy=_save_strategy(args),
                                      content_metadata=checkpoint_common.content_metadata(args),
                                      async_sharded_save=True, **strategy)

    def publish() -> None:
        if torch.distributed.get_rank() == 0:
            checkpoint_dir.publish(partial, iteration)
        torch.distributed.barrier()

    request.add_finalize_fn(publish)
    _ASYNC_SAVES.schedule_async_request(request)


def finalize_async_saves(blocking: bool = False) -> None:
    """Publish the asynchronous saves every rank has finished writing (all of them, waiting, when
    ``blocking``); every rank calls it at the same points. A writer's failure is raised on every rank."""
    if _ASYNC_SAVES is not None:
        _ASYNC_SAVES.maybe_finalize_async_calls(blocking=blocking)


def _save_strategy(args):
    """megatron's default torch_dist writer; with --ckpt-fully-parallel-save (Megatron-LM's meaning) the
    data-parallel replicas split the writing of what they hold alike, instead of the first replica writing
    it all. None: megatron's default."""
    if not args.ckpt_fully_parallel_save:
        return None
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    return FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy(),
                                            parallel_state.get_data_parallel_group(with_context_parallel=True))


def _load_strategy(args, checkpoint: Path):
    """megatron's default reader; with --ckpt-fully-parallel-load each data-parallel replica reads a part of
    what they all need and they exchange it. None: megatron's default."""
    if not args.ckpt_fully_parallel_load:
        return None
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper

    return FullyParallelLoadStrategyWrapper(get_default_load_sharded_strategy(str(checkpoint)),
                                            parallel_state.get_data_parallel_group(with_context_parallel=True))


def recover_interrupted_save(args) -> None:
    """Rank 0 finishes or undoes what a save killed while publishing left in ``--save``, before anything
    is loaded from or saved there."""
    with shared_outcome(f"recovering {args.save}", _timeout(args)):
        if torch.distributed.get_rank() == 0 and Path(args.save).is_dir():
            for line in checkpoint_dir.recover_interrupted_save(args.save):
                print(f"{args.save}: {line}", flush=True)


def _timeout(args) -> datetime.timedelta:
    return datetime.timedelta(minutes=args.distributed_timeout_minutes)


def _fit_optimizer_chain(state: dict, optimizer, args) -> dict:
    """The loaded optimizer state in the shape of this run's chain of optimizers.

    megatron-core gives a MoE model's experts an optimizer of their own at EP > 1 and keeps them with the
    dense parameters at EP 1, and it saves each optimizer's param groups (with Adam's step) as they are. The
    distributed optimizer's parameter states are saved per parameter (fully reshardable, without chain
    prefixes) and load into either chain, but the param groups come back in the saving chain's shape, which
    megatron cannot read into another. Here each optimizer of this run gets the saved groups it needs, found
    by megatron's group identifiers (wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr); an expert group
    the checkpoint lacks (it was saved at EP 1) is the dense group of the same multipliers."""
    chain = optimizer.chained_optimizers
    indices = sorted(key for key in state if isinstance(key, int))
    if len(indices) in (0, len(state)):
        return state  # saved by a chain of the same shape: one optimizer's entries, or one entry per optimizer
    if not args.use_distributed_optimizer:
        raise ArgumentError(
            f"--load {args.load}: its optimizer was saved at another expert parallel size (a chain of "
            f"{len(indices) if len(chain) == 1 else 1}, this run has {len(chain)}), which megatron's "
            "non-distributed optimizer cannot read: load the weights alone with --no-load-optim, or train with "
            "--use-distributed-optimizer, whose saved state every expert parallel size reads")
    saved_single = "optimizer" in state
    saved = [state] if saved_single else [state[i] for i in indices]
    param_states = [state[i]["param_state"] for i in indices] if saved_single else [state["param_state"]]
    groups = [group for entry in saved for group in entry["optimizer"]["param_groups"]]
    common = {k: v for k, v in saved[0].items() if k not in ("optimizer", "param_state") and not isinstance(k, int)}
    fitted = [{**common, "param_state": param_state,
               "optimizer": {"param_groups": [_saved_group(groups, g) for g in member.optimizer.param_groups]}}
              for member, param_state in zip(chain, param_states)]
    return fitted[0] if len(fitted) == 1 else dict(enumerate(fitted))


def _saved_group(groups: list[dict], needed: dict) -> dict:
    """The saved param group with ``needed``'s identifiers; else one differing in is_expert_parallel only,
    marked as ``needed`` is."""
    def identity(group: dict, with_expert: bool = True) -> tuple:
        # as megatron pairs groups: a key under NeMo's pre_ alias counts, and a missing one is None (0.19
        # identifies groups by more keys, end_wd & co., which groups saved before may lack)
        return tuple(group.get(k, group.get(f"pre_{k}")) for k in param_group_identifier_keys
                     if with_expert or k != "is_expert_parallel")

    for with_expert in (True, False):
        for group in groups:
            if identity(group, with_expert) == identity(needed, with_expert):
                return {**group, "is_expert_parallel": needed["is_expert_parallel"]}
    wanted = dict(zip(param_group_identifier_keys, identity(needed)))
    raise ArgumentError(f"the checkpoint's optimizer has no param group for {wanted}: load it with --no-load-optim")


def _read_common(args, checkpoint: Path) -> dict:
    """The checkpoint's plain state, in the format this run loads (--ckpt-format); one in the other format is
    refused in one line."""
    saved = fsdp_checkpoint.format_of(checkpoint)
    if saved != args.ckpt_format:
        flags = ("--use-megatron-fsdp --ckpt-format fsdp_dtensor" if saved == fsdp_checkpoint.FORMAT else
                 "DDP or --use-torch-fsdp2, --ckpt-format torch_dist")
        raise ArgumentError(f"--load {checkpoint}: a {saved} checkpoint, which a run with --ckpt-format "
                            f"{args.ckpt_format} does not read: load it as it was saved ({flags})")
    if saved == fsdp_checkpoint.FORMAT:
        return fsdp_checkpoint.read_plain(checkpoint)
    return checkpoint_dir.read_common(checkpoint)


def _load_model_and_optimizer(args, checkpoint: Path, state: dict, model: list, optimizer,
                              with_optimizer: bool) -> dict:
    """Read ``state`` from ``checkpoint`` and put it into the model and the optimizer; returns what was read.
    As Megatron-LM: torch FSDP2's model and optimizer tensors are read in place, and only the optimizer's step,
    which its ``load_state_dict`` would restore, is put back (``sharding.restore_saved_step``)."""
    if args.ckpt_format == fsdp_checkpoint.FORMAT:
        return fsdp_checkpoint.load(state, checkpoint, model, optimizer, with_optimizer, args.model_config)
    loaded = dist_checkpointing.load(state, str(checkpoint), sharded_strategy=_load_strategy(args, checkpoint))
    if args.use_torch_fsdp2:
        if with_optimizer:
            sharding.restore_saved_step(str(checkpoint), optimizer)
        return loaded
    chunks = [chunk.module if hasattr(chunk, "module") else chunk for chunk in model]
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(loaded["model"] if len(chunks) == 1 else loaded[f"model{i}"])
    if with_optimizer:
        with torch.no_grad():  # megatron's loader copies into views of the parameters
            optimizer.load_state_dict(_fit_optimizer_chain(loaded["optimizer"], optimizer, args))
    return loaded


def _require_reshardable(checkpoint: Path, optimizer_format: dict, saved: dict, args) -> None:
    """Megatron-LM saves the distributed optimizer's state ``dp_reshardable`` unless told
    --dist-ckpt-optim-fully-reshardable: laid out as its buffers are, which only the same TP, PP, VPP, EP and
    expert TP read (megatron raises deep inside its load otherwise). One line, before any rank reads."""
    sharding = optimizer_format.get("distrib_optim_sharding_type")
    current = checkpoint_common.layout(args)
    differ = {key: (saved.get(key), current[key]) for key in ("tp", "pp", "vpp", "ep", "etp")
              if saved.get(key) != current[key]}
    if sharding not in checkpoint_common.FULLY_RESHARDABLE and differ:
        sizes = ", ".join(f"{key} {was} (now {now})" for key, (was, now) in differ.items())
        raise ArgumentError(
            f"--load {checkpoint}: its distributed optimizer state is {sharding}, which reads only at the layout "
            f"that saved it ({sizes}): resume at that layout, load the weights alone with --no-load-optim, or "
            "save it with --dist-ckpt-optim-fully-reshardable (Megatron-LM)")


def load_checkpoint(args, model: list, optimizer, scheduler) -> tuple[int, dict]:
    """Load ``args.load`` (the latest iteration, or a converted release) into model, optimizer and
    scheduler; returns the iteration to continue from and the consumed samples."""
    consumed = {"train": 0, "valid": 0}
    checkpoint = checkpoint_dir.checkpoint_to_load(args.load)
    if checkpoint is None:
        if torch.distributed.get_rank() == 0:
            print(f"no checkpoint in {args.load}: training from scratch", flush=True)
        return 0, consumed
    common = _read_common(args, checkpoint)
    checkpoint_common.refuse_another_model(common, args, checkpoint)
    release = checkpoint.name == checkpoint_dir.RELEASE
    weights_only = release or args.finetune
    same_layout = _same_rng_layout(common, args)
    with_optimizer = not (weights_only or args.no_load_optim or "opt_param_scheduler" not in common)
    with_rng = not (weights_only or args.no_load_rng) and same_layout
    optimizer_format = checkpoint_common.loading_metadata(common)
    if with_optimizer and args.use_distributed_optimizer:
        _require_reshardable(checkpoint, optimizer_format, checkpoint_common.saved_layout(common), args)
    state = _sharded_state(args, model, optimizer, scheduler, 0, consumed, is_loading=True,
                           with_optimizer=with_optimizer, with_rng=with_rng, optimizer_format=optimizer_format,
                           common=common)
    if weights_only:
        state = {k: v for k, v in state.items() if k == "model" or k.startswith("model")}
    loaded = _load_model_and_optimizer(args, checkpoint, state, model, optimizer, with_optimizer)
    if with_optimizer:
        scheduler.load_state_dict(loaded["opt_param_scheduler"])
    if with_rng:
        _set_rng_state(loaded["rng_state"])
    if weights_only:
        return 0, consumed
    consumed = checkpoint_common.consumed_samples(common)
    if torch.distributed.get_rank() == 0:
        saved_at = checkpoint_common.saved_layout(common)
        print(f"loaded {checkpoint} (iteration {common['iteration']}"
              + ("" if same_layout else f", saved at {saved_at}, RNG states not restored") + ")", flush=True)
    return common["iteration"], consumed

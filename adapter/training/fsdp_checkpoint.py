"""Megatron-FSDP's checkpoint format, ``--ckpt-format fsdp_dtensor``, as Megatron-LM writes and reads it: the
wrapped model's DTensors (``state_dict_for_save_checkpoint``), the distributed optimizer's state one DTensor per
parameter (its ``fsdp_dtensor`` sharding), prepared for uneven shards by megatron_fsdp
(``preprocess_state_dict_for_uneven_dtensor``), through ``torch.distributed.checkpoint``; the plain values
(iteration, consumed samples, scheduler) beside them, the RNG states under their (PP, TP) rank.

It keeps the flow's checkpoint layout and its guarantee (``adapter.training.checkpointing``): every rank writes
into the ``.partial`` directory, and rank 0 publishes it. torch writes ``.metadata`` once every rank's shards
are written; megatron's ``metadata.json`` (its sharded backend named ``fsdp_dtensor``) is written after it, so
the flow's completeness test (both files there) holds for this format too, and a load tells the formats apart.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.core import CheckpointingConfig, maybe_load_config, save_config

FORMAT = "fsdp_dtensor"
# the plain values of a checkpoint (adapter.training.checkpointing's), read before the model is loaded
PLAIN = ("iteration", "checkpoint_version", "consumed_train_samples", "consumed_valid_samples", "layout")


def state_dict(plain: dict, model: list, optimizer, scheduler, rng, is_loading: bool, with_optimizer: bool) -> dict:
    """What an fsdp_dtensor checkpoint holds (what a load fills in place): ``plain``, each chunk's DTensors, the
    optimizer's and the scheduler's state with ``with_optimizer``, the RNG ShardedObject ``rng``'s states under
    its rank's key (torch writes every rank's plain values, one copy per key)."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        preprocess_state_dict_for_uneven_dtensor,
    )

    state = dict(plain)
    chunks = [chunk.state_dict_for_save_checkpoint() for chunk in model]
    state.update({"model": chunks[0]} if len(chunks) == 1 else {f"model{i}": c for i, c in enumerate(chunks)})
    if with_optimizer:
        metadata = {"distrib_optim_sharding_type": FORMAT, "singleton_local_shards": False,
                    "chained_optim_avoid_prefix": True,
                    "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading, metadata=metadata)
        state["opt_param_scheduler"] = scheduler.state_dict()
    if rng is not None:
        state["rng_state"] = {str(rng.global_offset): rng.data}
    return preprocess_state_dict_for_uneven_dtensor(state)


def save(state: dict, directory: Path) -> None:
    """Every rank writes its shards of ``state`` into ``directory``; then rank 0 marks it complete."""
    dcp.save(state, checkpoint_id=str(directory))
    if torch.distributed.get_rank() == 0:  # torch's save has written .metadata on return
        save_config(CheckpointingConfig(sharded_backend=FORMAT), str(directory))


def load(state: dict, directory: Path, model: list, optimizer, with_optimizer: bool) -> dict:
    """Read ``directory`` into ``state`` (in place, its DTensors included), then into the model chunks and, with
    ``with_optimizer``, the optimizer, as Megatron-LM does after the read; returns ``state``, its RNG states
    this rank's."""
    dcp.load(state, checkpoint_id=str(directory))
    for i, chunk in enumerate(model):
        chunk.load_state_dict(state["model"] if len(model) == 1 else state[f"model{i}"])
    if with_optimizer:
        optimizer.load_state_dict(state["optimizer"])
    if "rng_state" in state:  # this rank's, as the torch_dist format's ShardedObject gives it back
        [state["rng_state"]] = state["rng_state"].values()
    return state


def read_plain(directory: Path) -> dict:
    """The plain values of the checkpoint in ``directory`` (every rank reads them: torch's load is collective),
    and ``opt_param_scheduler`` where it holds the optimizer's state."""
    saved = dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    flat = {key: None for key in saved if key.split(".", 1)[0] in PLAIN}
    dcp.load(flat, checkpoint_id=str(directory))
    plain: dict = {}
    for key, value in flat.items():
        name, _, field = key.partition(".")
        if field:
            plain.setdefault(name, {})[field] = value
        else:
            plain[name] = value
    if any(key.startswith("opt_param_scheduler.") for key in saved):
        plain["opt_param_scheduler"] = True
    return plain


def format_of(directory: Path) -> str:
    """The format megatron's ``metadata.json`` in ``directory`` names (torch_dist for megatron's own saves)."""
    config = maybe_load_config(str(directory))
    return config.sharded_backend if config is not None else "torch_dist"

"""Megatron-FSDP's checkpoint format, ``--ckpt-format fsdp_dtensor``, as Megatron-LM writes and reads it: the
wrapped model's DTensors (``state_dict_for_save_checkpoint``), the distributed optimizer's state one DTensor per
parameter (its ``fsdp_dtensor`` sharding), prepared for uneven shards by megatron_fsdp
(``preprocess_state_dict_for_uneven_dtensor``), through ``torch.distributed.checkpoint``; the plain values
(iteration, consumed samples, scheduler) beside them, the RNG states under their (PP, TP) rank ((PP, TP, DP) with
EP > 1). Before torch reads or writes it, it is prepared as Megatron-LM's ``preprocess_fsdp_dtensor_state_dict``
prepares it, with the same megatron-core steps (``_prepared``): a SwiGLU ``linear_fc1`` is saved as its gate and
up halves, so a checkpoint saved at one TP x DP resumes at another.

It keeps the flow's checkpoint layout and its guarantee (``adapter.training.checkpointing``): every rank writes
into the ``.partial`` directory, and rank 0 publishes it. torch writes ``.metadata`` once every rank's shards
are written, the flow's completeness test for this format (``adapter.checkpoint_dir.is_complete``). Like
Megatron-LM it writes no megatron ``metadata.json`` (the flow's before did, naming ``fsdp_dtensor``, and still
load): Megatron-LM takes a directory with one for torch_dist, so it could not resume them.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.core import maybe_load_config

FORMAT = "fsdp_dtensor"
# the plain values of a checkpoint (adapter.training.checkpointing's), read before the model is loaded
PLAIN = ("iteration", "checkpoint_version", "consumed_train_samples", "consumed_valid_samples", "layout", "args")


def state_dict(plain: dict, model: list, optimizer, scheduler, rng, is_loading: bool, with_optimizer: bool) -> dict:
    """What an fsdp_dtensor checkpoint holds before Megatron-LM's preparation (``_prepared``): ``plain``, each
    chunk's DTensors, the optimizer's and the scheduler's state with ``with_optimizer``, the RNG ShardedObject
    ``rng``'s states under its rank's key (its ``global_offset``), and Megatron-LM's names (torch writes every rank's
    plain values, one copy per key). A load fills it in place."""
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
    return state


def _prepared(state: dict, model: list, model_config) -> dict:
    """``state`` as Megatron-LM's ``preprocess_fsdp_dtensor_state_dict`` prepares it for torch's save and load
    (its megatron-core steps, handed the module Megatron-LM hands them: ``unwrap_model`` of the first chunk):
    FP8 extra states dropped; with SwiGLU each ``linear_fc1`` (weight and Adam moments) split into its gate and
    up halves (``_w``, ``_v``), views of the fused tensors, so that a checkpoint saved at one TP reads at
    another (the fused rows of a TP rank are its gate rows, then its up rows: not one tensor across TP ranks);
    with experts each under its global index; DTensors marked for megatron_fsdp's uneven shards. ``state`` is
    left as it was: its fused tensors are what the model and the optimizer load."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        preprocess_state_dict_for_uneven_dtensor,
    )
    from megatron.core.transformer import fsdp_dtensor_checkpoint as mlm
    from megatron.core.utils import unwrap_model

    prepared = dict(state)
    if "model" in prepared:
        prepared["model"] = dict(prepared["model"])
        mlm.handle_fp8_extra_state_case(prepared["model"])
        if model_config.activation == "swiglu":
            prepared["model"], optimizer = mlm.handle_swiglu_in_state_dict(
                unwrap_model(model[0]), prepared["model"], prepared.get("optimizer"))
            if optimizer is not None:
                prepared["optimizer"] = optimizer
        if model_config.num_experts:
            prepared["model"] = mlm.handle_experts_in_state_dict(prepared["model"], model_config.num_experts)
    return preprocess_state_dict_for_uneven_dtensor(prepared)


def save(state: dict, directory: Path, model: list, model_config) -> None:
    """Every rank writes its shards of ``state``, prepared as Megatron-LM prepares it, into ``directory``; torch
    writes ``.metadata`` last, once every rank's are written."""
    dcp.save(_prepared(state, model, model_config), checkpoint_id=str(directory))


def load(state: dict, directory: Path, model: list, optimizer, with_optimizer: bool, model_config) -> dict:
    """Read ``directory`` into ``state`` as Megatron-LM does: torch reads into the prepared state (the SwiGLU
    halves are views of ``state``'s fused tensors), then the model chunks and, with ``with_optimizer``, the
    optimizer load ``state``'s; returns what was read, its RNG states this rank's."""
    # the plain values were read before (read_plain); Megatron-LM's checkpoint lacks the flow's own among them
    prepared = {key: value for key, value in _prepared(state, model, model_config).items() if key not in PLAIN}
    _refuse_missing(prepared, directory)
    dcp.load(prepared, checkpoint_id=str(directory))
    loaded = {**prepared, **{key: state[key] for key in state if key == "optimizer" or key.startswith("model")}}
    for i, chunk in enumerate(model):
        chunk.load_state_dict(loaded["model"] if len(model) == 1 else loaded[f"model{i}"])
    if with_optimizer:
        optimizer.load_state_dict(loaded["optimizer"])
    if "rng_state" in loaded:  # this rank's, as the torch_dist format's ShardedObject gives it back
        [loaded["rng_state"]] = loaded["rng_state"].values()
    return loaded


def _refuse_missing(prepared: dict, directory: Path) -> None:
    """One line where the checkpoint lacks tensors this run reads (torch's strict load would raise its own
    traceback on every rank): another model's checkpoint (either flow's checkpoint of this model reads)."""
    from megatron.core.transformer.fsdp_dtensor_checkpoint import flatten_state_dict

    from adapter.training.arguments import ArgumentError

    saved = dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    # tensors: every other value torch keeps whole where it holds no tensor (a list of numbers), megatron flattens
    missing = sorted(key for key, value in flatten_state_dict(prepared).items()
                     if torch.is_tensor(value) and key not in saved)
    if missing:
        raise ArgumentError(f"--load {directory}: the checkpoint lacks {len(missing)} of the entries this run "
                            f"reads (e.g. {missing[0]}): it was saved by another model: load it with the "
                            "model and flags that saved it")


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
    """The format megatron's ``metadata.json`` in ``directory`` names (torch_dist for megatron's own saves, and
    fsdp_dtensor for the flow's before it wrote none); without one, torch's checkpoint is fsdp_dtensor, as
    Megatron-LM reads it under Megatron-FSDP."""
    config = maybe_load_config(str(directory))
    if config is not None:
        return config.sharded_backend
    return FORMAT if (directory / ".metadata").is_file() else "torch_dist"

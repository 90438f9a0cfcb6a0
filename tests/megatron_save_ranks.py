"""Rank functions for tests/test_megatron_training_save.py: megatron.training's own ``save_checkpoint`` and
``load_checkpoint`` (megatron-core's wheel ships them from 0.17) on a model the flow builds, saved, killed in
a save, failing in one, and loaded by a fresh start."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import adapter  # noqa: F401 - before megatron
import torch

from adapter import checkpoint_dir
from tests.checkpoint_interchange_ranks import _megatron_lm_args, _scramble
from tests.flow_ranks import after, fail_in, run_pretrain_keeping_setup


def _built(argv: list[str], save: str) -> tuple:
    """The model, optimizer and scheduler of scripts/pretrain_gpt.py (megatron.training's ``pretrain``)
    after one iteration; Megatron-LM's arguments (``--save`` and
    ``--load`` ``save``) set as its global ones."""
    _, built = run_pretrain_keeping_setup(argv + ["--train-iters", "1"], keep_group=True)
    _megatron_lm_args(argv + ["--train-iters", "1", "--save", save, "--save-interval", "1000"], save)
    return built


def _params(model: list) -> list[torch.Tensor]:
    return [p.detach().clone() for chunk in model for p in chunk.parameters()]


def _save(iteration: int, built: tuple) -> None:
    from megatron.training import checkpointing

    checkpointing.save_checkpoint(iteration, *built, 0)


def _dist_checkpointing():
    """megatron.core.dist_checkpointing, whose ``save`` megatron.training's save_checkpoint calls."""
    from megatron.training import checkpointing

    return checkpointing.dist_checkpointing


# what has just happened in the re-save of an iteration when rank 0 kills every rank
KILLS = {
    "partial written": lambda name, pids: after(
        _dist_checkpointing(), "save",
        lambda state, directory, *a, **k: Path(directory).name == f".{name}{checkpoint_dir.PARTIAL}", "after", pids),
    "old copy moved aside": lambda name, pids: after(
        checkpoint_dir.os, "rename", lambda src, dst: Path(src).name == name, "after", pids),
}


def saved_then_killed_resaving(argv: list[str], save: str, step: str, pid_dir: str) -> None:
    """Save iteration 1 asynchronously (published when megatron finalizes it), keep this rank's parameters
    beside ``save``, then save iteration 1 again, every rank SIGKILLed by rank 0 at ``step``."""
    from megatron.training.async_utils import maybe_finalize_async_save
    from megatron.training.global_vars import get_args

    Path(pid_dir, f"rank{os.environ['RANK']}").write_text(str(os.getpid()))
    built = _built(argv, save)
    get_args().async_save = True
    _save(1, built)
    maybe_finalize_async_save(blocking=True)
    torch.save(_params(built[0]), Path(save).parent / f"live{os.environ['RANK']}.pt")
    get_args().async_save = False
    torch.distributed.barrier()
    if os.environ["RANK"] == "0":
        KILLS[step](checkpoint_dir.checkpoint_name(1), pid_dir)
    _save(1, built)


def loaded_after_the_kill(argv: list[str], save: str) -> dict:
    """A fresh start: megatron's ``load_checkpoint`` of ``save`` into the scrambled model; the iteration it
    loaded and whether the parameters are the ones saved."""
    from megatron.training import checkpointing

    model, optimizer, scheduler = _built(argv, save)
    _scramble(model, optimizer, scheduler)
    iteration, _ = checkpointing.load_checkpoint(model, optimizer, scheduler)
    saved = torch.load(Path(save).parent / f"live{os.environ['RANK']}.pt")
    same = all(torch.equal(a, b) for a, b in zip(_params(model), saved, strict=True))
    torch.distributed.destroy_process_group()
    return {"iteration": iteration, "same": same}


FAILURES = {  # failure -> (its rank, what makes the save of iteration 2 fail there)
    "rank 1 cannot write": (1, lambda: fail_in(
        _dist_checkpointing(), "save",
        lambda state, directory, *a, **k: checkpoint_dir.checkpoint_name(2) in str(directory),
        OSError(errno.ENOSPC, "No space left on device"))),
}


def saved_then_failing(argv: list[str], save: str, failure: str) -> None:
    """Save iteration 1, then iteration 2 failing on one rank as ``failure`` says."""
    built = _built(argv, save)
    _save(1, built)
    rank, install = FAILURES[failure]
    if int(os.environ["RANK"]) == rank:
        install()
    _save(2, built)

"""Rank functions for the pretrain-flow tests: scripts/pretrain_gpt.py's step (adapter.training.gpt_step) and
dataset provider through ``pretrain``, as they are, killed at a step of a save, failing in one, or inspected
after training."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import shutil
import signal
from pathlib import Path

import adapter  # noqa: F401 - before megatron
import psutil
import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
from megatron.core.enums import ModelType

from adapter import checkpoint_dir
from models import torch_dist_io
from adapter.training import checkpointing
from adapter.training import pretrain as flow
from models.verify import megatron_logits
from adapter.training.data import train_valid_test_datasets_provider
from adapter.training.gpt_step import forward_step, model_provider


def stopped_at(saved: Path, iteration: int, into: Path) -> Path:
    """A save directory holding only ``saved``'s checkpoint of ``iteration``, as if that run had stopped
    there: one run gives a reference curve and the checkpoint to resume it from (a save leaves the curve as
    it is, which the resumed runs then show bit for bit)."""
    shutil.copytree(saved / checkpoint_dir.checkpoint_name(iteration), into / checkpoint_dir.checkpoint_name(iteration))
    (into / checkpoint_dir.TRACKER).write_text(str(iteration))
    return into


def run_pretrain(argv: list[str], keep_group: bool = False) -> dict:
    history = flow.pretrain(train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder,
                            forward_step, argv=argv)
    if not keep_group:
        torch.distributed.destroy_process_group()
    return history


def run_pretrain_keeping_setup(argv: list[str], keep_group: bool = False) -> tuple[dict, tuple]:
    """As run_pretrain, and what ``setup_model_and_optimizer`` built: (model chunks, optimizer, scheduler);
    with ``keep_group`` the process group stays for the caller's own work on them."""
    built = []
    setup = flow.setup_model_and_optimizer

    def kept_setup(*args, **kwargs):
        built.append(setup(*args, **kwargs))
        return built[-1]

    flow.setup_model_and_optimizer = kept_setup
    try:
        return run_pretrain(argv, keep_group), built[0]
    finally:
        flow.setup_model_and_optimizer = setup


def logged_losses(results: list[dict]) -> dict[int, float]:
    """iteration -> lm loss of one run's ranks (``run_pretrain``'s results), from the last rank that logged
    one: the last pipeline stage's, whose ranks all log the same."""
    curves = [{entry["iteration"]: entry["lm loss"] for entry in r["train"] if "lm loss" in entry} for r in results]
    curves = [c for c in curves if c]
    assert curves, "no rank logged a loss"
    return curves[-1]


def run_pretrain_printing(argv: list[str]) -> dict:
    """As run_pretrain, with what this rank printed under "stdout" (the last rank prints the iteration lines)."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        history = run_pretrain(argv)
    return {**history, "stdout": printed.getvalue()}


# the steps of a save, each named by what has just happened when the test kills every process
KILL_STEPS = ("partial made", "partial written", "old copy moved aside", "new copy moved in", "tracker replaced")


def run_pretrain_killed_at(argv: list[str], iteration: int, step: str, pid_dir: str) -> dict:
    """As run_pretrain, but when the save of ``iteration`` reaches ``step`` (rank 0 watching) every rank's
    process is SIGKILLed, as a node failure or a job scheduler would."""
    Path(pid_dir, f"rank{os.environ['RANK']}").write_text(str(os.getpid()))
    if os.environ["RANK"] == "0":
        name = checkpoint_dir.checkpoint_name(iteration)
        _after(checkpointing.dist_checkpointing, "save", lambda state, directory, *a, **k: name in directory,
               {"partial made": "before", "partial written": "after"}.get(step), pid_dir)
        moved = {"old copy moved aside": lambda src, dst: Path(src).name == name,
                 "new copy moved in": lambda src, dst: Path(dst).name == name}
        if step in moved:
            _after(checkpoint_dir.os, "rename", moved[step], "after", pid_dir)
        if step == "tracker replaced":
            _after(checkpoint_dir.os, "replace", lambda src, dst: Path(dst).name == checkpoint_dir.TRACKER and
                   Path(dst).read_text() == str(iteration), "after", pid_dir)
    return run_pretrain(argv)


def _after(owner, attribute: str, matches, when: str | None, pid_dir: str) -> None:
    """Wrap ``owner.attribute`` so that a call for which ``matches(*args)`` kills every rank, ``before``
    or ``after`` it runs."""
    if when is None:
        return
    original = getattr(owner, attribute)

    def call(*args, **kwargs):
        if when == "before" and matches(*args):
            _kill_every_rank(pid_dir)
        result = original(*args, **kwargs)
        if when == "after" and matches(*args):
            _kill_every_rank(pid_dir)
        return result

    setattr(owner, attribute, call)


def _kill_every_rank(pid_dir: str) -> None:
    """SIGKILL every rank, this one last, and the processes they started (megatron's checkpoint writer
    manager), which would otherwise outlive the test."""
    ranks = [psutil.Process(int(p.read_text())) for p in Path(pid_dir).iterdir()]
    children = [child for rank in ranks for child in rank.children(recursive=True)]
    for process in children + sorted(ranks, key=lambda rank: rank.pid == os.getpid()):
        with contextlib.suppress(psutil.NoSuchProcess):
            process.send_signal(signal.SIGKILL)


def _failures(iteration: int) -> dict:
    """failure -> (the rank it happens on, what makes it happen there)."""
    name = checkpoint_dir.checkpoint_name(iteration)
    return {
        # rank 1's disk fills up as it starts writing; rank 0 is then inside megatron's collectives
        "rank 1 cannot write": (1, lambda: _fail_in(
            checkpointing.dist_checkpointing, "save", lambda state, directory, *a, **k: name in directory,
            OSError(errno.ENOSPC, "No space left on device"))),
        # rank 0 may not rename the written checkpoint into place; the others wait in the closing barrier
        "rank 0 cannot publish": (0, lambda: _fail_in(
            checkpoint_dir.os, "rename", lambda src, dst: Path(dst).name == name,
            PermissionError(errno.EACCES, "Permission denied"))),
    }


def run_pretrain_failing(argv: list[str], iteration: int, failure: str) -> dict:
    """As run_pretrain, with the save of ``iteration`` failing on one rank as ``failure`` says."""
    rank, install = _failures(iteration)[failure]
    if int(os.environ["RANK"]) == rank:
        install()
    return run_pretrain(argv)


def _fail_in(owner, attribute: str, matches, error: OSError) -> None:
    original = getattr(owner, attribute)

    def call(*args, **kwargs):
        if matches(*args, **kwargs):
            raise error
        return original(*args, **kwargs)

    setattr(owner, attribute, call)


def run_pretrain_and_compare_with_saved(argv: list[str], tokens: torch.Tensor) -> dict:
    """Train (and save at the end), then compare this rank's live parameters, as the next forward uses them,
    with the checkpoint's. Also returns whether, right after the last optimizer step, the parameters were
    not yet all fresh (the deferred all-gather the save must not miss), and the live logits for ``tokens``."""
    chunks, stale = [], {}
    setup, step = flow.setup_model_and_optimizer, flow.train_step

    def kept_setup(*args, **kwargs):
        built = setup(*args, **kwargs)
        chunks.extend(built[0])
        return built

    def snapshot_step(*args, **kwargs):
        result = step(*args, **kwargs)
        stale.update(_parameters(chunks))
        return result

    flow.setup_model_and_optimizer, flow.train_step = kept_setup, snapshot_step
    flow.pretrain(train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder, forward_step,
                  argv=argv)
    args = flow.global_vars.get_args()
    logits = megatron_logits(chunks, tokens, args.model_config)  # the next forward: its hooks gather all
    live = _parameters(chunks)
    reader = torch_dist_io.checkpoint_reader(checkpoint_dir.iteration_dir(args.save))
    saved = torch_dist_io.read_regions(reader, {t.key: ((0,) * len(t.global_shape), tuple(t.global_shape), t.dtype)
                                        for t in _sharded_tensors(chunks)})
    saved = {(t.key, t.global_offset): saved[t.key][tuple(slice(o, o + n) for o, n in zip(
        t.global_offset, (1,) * t.prepend_axis_num + tuple(t.local_shape)))].reshape(t.data.shape)
        for t in _sharded_tensors(chunks)}
    torch.distributed.destroy_process_group()
    return {"saved equals live": {str(key): torch.equal(saved[key], t) for key, t in live.items()},
            "stale after the step": any(not torch.equal(stale[key], t) for key, t in live.items()),
            "logits": logits}


def _sharded_tensors(chunks: list) -> list[ShardedTensor]:
    sharded = chunks[0].module.sharded_state_dict()
    apply_factories(sharded)
    return [t for t in nested_values(sharded) if isinstance(t, ShardedTensor)]


def _parameters(chunks: list) -> dict[tuple, torch.Tensor]:
    """(checkpoint key, offset) -> a copy of this rank's tensor there (whole layers at TP 1 x PP 1)."""
    return {(t.key, t.global_offset): t.data.detach().clone() for t in _sharded_tensors(chunks)}


def run_pretrain_noting_reruns(argv: list[str]) -> dict:
    """As run_pretrain, with what megatron's rerun state machine logged on this rank under "reruns"."""
    import logging

    noted: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: noted.append(record.getMessage())
    logging.getLogger("megatron.core.rerun_state_machine").addHandler(handler)
    return {**run_pretrain(argv), "reruns": noted}

"""Rank functions for the in-process tests of the one flow: ``scripts/pretrain_gpt.py``'s ``pretrain``
(megatron.training's own, through ``flow.pretrain.run``) in the rank's process, with what it logged kept for
the test. megatron.training's ``pretrain`` returns nothing, so the scalars come from its own calls: each
``training_log`` (the iteration's reduced losses, before megatron averages them over its log interval) and
each ``evaluate``."""

from __future__ import annotations

import contextlib
import inspect
import io
import os
import re
import shutil
import signal
from pathlib import Path

import adapter  # noqa: F401 - before megatron
import psutil
import torch

from adapter import checkpoint_dir
from flow import pretrain as flow


def _scalar(value) -> float:
    return float(value.float().mean()) if isinstance(value, torch.Tensor) else float(value)


@contextlib.contextmanager
def _recording(history: dict):
    """megatron.training's ``training_log`` and ``evaluate`` record into ``history`` while the block runs."""
    from megatron.training import training

    log, evaluate, printing = training.training_log, training.evaluate, training.evaluate_and_print_results
    signature, printing_signature = inspect.signature(log), inspect.signature(printing)
    evaluating = {}

    def recorded_log(*args, **kwargs):
        bound = signature.bind(*args, **kwargs).arguments
        entry = {"iteration": int(bound["iteration"]), "skipped": int(bound["skipped_iter"]),
                 "grad norm": None if bound["grad_norm"] is None else float(bound["grad_norm"]),
                 **{name: _scalar(value) for name, value in bound["loss_dict"].items()}}
        history["train"].append(entry)
        return log(*args, **kwargs)

    def recorded_printing(*args, **kwargs):
        bound = printing_signature.bind(*args, **kwargs).arguments
        evaluating.update(iteration=int(bound["iteration"]), set="test" if "test set" in bound["prefix"] else
                          "validation", final="set" in bound["prefix"])
        return printing(*args, **kwargs)

    def recorded_evaluate(*args, **kwargs):
        result = evaluate(*args, **kwargs)
        if result[0] is not None:
            history["validation"].append({**evaluating, **{name: _scalar(v) for name, v in result[0].items()}})
        return result

    training.training_log, training.evaluate = recorded_log, recorded_evaluate
    training.evaluate_and_print_results = recorded_printing
    try:
        yield
    finally:
        training.training_log, training.evaluate, training.evaluate_and_print_results = log, evaluate, printing


def run_pretrain(argv: list[str], keep_group: bool = False) -> dict:
    """``scripts/pretrain_gpt.py argv`` in this rank's process: {"train": one entry per iteration (its number,
    its losses as the step reduced them, "grad norm", "skipped"), "validation": one per evaluation (its
    iteration, "set": validation or test, "final": the evaluation after training, and its losses),
    "stdout": what this rank printed}. A run megatron ends early with exit status 0 (``sys.exit``) returns
    as well."""
    history, printed = {"train": [], "validation": []}, io.StringIO()
    with _recording(history), contextlib.redirect_stdout(printed):
        try:
            flow.run(argv)
        except SystemExit as stop:  # megatron.training's early exits (--exit-interval, a time budget) end so
            if stop.code not in (0, None):
                raise
    history["stdout"] = printed.getvalue()
    if not keep_group and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return history


def run_pretrain_keeping_setup(argv: list[str], keep_group: bool = False) -> tuple[dict, tuple]:
    """As run_pretrain, and what megatron.training's ``setup_model_and_optimizer`` built: (model chunks,
    optimizer, scheduler); with ``keep_group`` the process group stays for the caller's own work on them."""
    from megatron.training import training

    built, setup = [], training.setup_model_and_optimizer

    def kept_setup(*args, **kwargs):
        built.append(setup(*args, **kwargs))
        return built[-1]

    training.setup_model_and_optimizer = kept_setup
    try:
        return run_pretrain(argv, keep_group), built[0]
    finally:
        training.setup_model_and_optimizer = setup


def logged_losses(results: list[dict], name: str = "lm loss") -> dict[int, float]:
    """iteration -> ``name`` of one run's ranks (``run_pretrain``'s results), from the last rank that logged
    one: the last pipeline stage's, whose ranks all log the same."""
    curves = [{entry["iteration"]: entry[name] for entry in r["train"] if name in entry} for r in results]
    curves = [c for c in curves if c]
    assert curves, "no rank logged " + name
    return curves[-1]


def printed_losses(results: list[dict], name: str) -> dict[int, float]:
    """iteration -> ``name`` as megatron's iteration lines printed it (averaged over --log-interval), from
    whichever rank printed them: for the losses megatron adds to its line but not to the step's loss dict (the
    MTP layers' "mtp_1 loss", ...)."""
    pattern = re.compile(r"\] iteration +(\d+)/.*\| " + re.escape(name) + r": ([^ |]+)")
    found = (pattern.search(line) for r in results for line in r["stdout"].splitlines())
    curve = {int(match[1]): float(match[2]) for match in found if match}
    assert curve, "no rank printed " + name
    return curve


def stopped_at(saved: Path, iteration: int, into: Path) -> Path:
    """A save directory holding only ``saved``'s checkpoint of ``iteration``, as if that run had stopped
    there: one run gives a reference curve and the checkpoint to resume it from (a save leaves the curve as
    it is, which the resumed runs then show bit for bit)."""
    name = checkpoint_dir.checkpoint_name(iteration)
    shutil.copytree(saved / name, into / name)
    (into / checkpoint_dir.TRACKER).write_text(str(iteration))
    return into


def after(owner, attribute: str, matches, when: str | None, pid_dir: str) -> None:
    """Wrap ``owner.attribute`` so that a call for which ``matches(*args)`` SIGKILLs every rank whose pid is
    in ``pid_dir``, ``before`` or ``after`` it runs (``when`` None: left as it is)."""
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


def fail_in(owner, attribute: str, matches, error: OSError) -> None:
    """Wrap ``owner.attribute`` so that a call for which ``matches(*args, **kwargs)`` raises ``error``."""
    original = getattr(owner, attribute)

    def call(*args, **kwargs):
        if matches(*args, **kwargs):
            raise error
        return original(*args, **kwargs)

    setattr(owner, attribute, call)

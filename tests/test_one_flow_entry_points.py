"""The project's ``scripts/pretrain_gpt.py`` and Megatron-LM's own ``pretrain_gpt.py`` are one training flow
(issue 50 point 7): on the same flags they train the same losses to the bit, and each resumes the other's
checkpoint on the curve it was saved on.

Needs a Megatron-LM checkout of the installed release on PYTHONPATH (tests/test_megatron_lm.py); skipped
with the reason otherwise. Both entry points then import that checkout's megatron.training:

    PYTHONPATH=/path/to/Megatron-LM pytest -m megatron_lm tests/test_one_flow_entry_points.py

Our side is given ``--model gpt-tiny``, Megatron-LM's side the flags ``models.megatron_lm_args`` writes for
that model, so equal losses (and equal saved arguments) also show that ``--model`` stands for those flags.
The layout is the one issue 50 names: TP2 with sequence parallelism x DP2 on 4 cpu ranks, the distributed
optimizer, dropout 0.1 (the dropout RNG streams must match and resume too), mock data.

Losses are read from each run's TensorBoard events (the float32 values megatron reduced: training loss per
iteration, validation and test losses), not from the log, which prints 7 digits and, after a restart, the
mean of two iterations. Every run has a directory of its own: its checkpoints, its TensorBoard events and
its dataset cache.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy
import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import models
from adapter.core_source import megatron_lm_checkout
from models.megatron_lm_args import flags
from tests.distributed import ROOT

pytestmark = [pytest.mark.megatron_lm, pytest.mark.multiproc, pytest.mark.slow]

MODEL = "gpt-tiny"
SAVED_AT, ITERATIONS = 4, 8
FLAGS = ["--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3", "--train-iters", str(ITERATIONS),
         "--eval-interval", str(SAVED_AT), "--eval-iters", "1", "--log-interval", "1", "--seed", "1234",
         "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256",
         "--tensor-model-parallel-size", "2", "--sequence-parallel", "--use-distributed-optimizer",
         "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
RANKS = 4


def _ours(args: list[str]) -> list[str]:
    """torchrun's script and arguments for the project's entry point."""
    return [str(ROOT / "scripts" / "pretrain_gpt.py"), "--model", MODEL, *args]


def _megatron_lms(args: list[str]) -> list[str]:
    """torchrun's script and arguments for Megatron-LM's own pretrain_gpt.py, the model as its flags."""
    return ["-m", "adapter.run", str(megatron_lm_checkout() / "pretrain_gpt.py"), *flags(models.get(MODEL)), *args]


def _train(run_dir: Path, entry, args: list[str]) -> dict[str, list[tuple[int, float]]]:
    """A run of ``entry`` on FLAGS and ``args`` in ``run_dir`` (made here); its losses (``_losses``), or the
    test fails with the log's tail."""
    run_dir.mkdir()
    own = ["--tensorboard-dir", str(run_dir / "tensorboard"), "--data-cache-path", str(run_dir / "cache")]
    env = {**os.environ, "ADAPTER_BACKEND": "cpu", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    log = run_dir / "train.log"
    with open(log, "w") as out:
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                               str(RANKS), *entry([*FLAGS, *own, *args])], cwd=run_dir, env=env,
                              stdout=out, stderr=subprocess.STDOUT, timeout=600)
    text = log.read_text()
    assert done.returncode == 0, f"{run_dir.name} failed (exit status {done.returncode}):\n{text[-6000:]}"
    return _losses(run_dir / "tensorboard")


def _losses(tensorboard: Path) -> dict[str, list[tuple[int, float]]]:
    """TensorBoard tag -> [(iteration, value)] of the losses, in the order written: megatron writes the
    evaluation at the last iteration, the final validation and the test loss under one tag and step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    losses = {}
    for events in sorted(tensorboard.rglob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(events), size_guidance={"scalars": 0})
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            if tag.startswith("lm loss") and not tag.endswith(" vs samples"):
                losses.setdefault(tag, []).extend((e.step, e.value) for e in accumulator.Scalars(tag))
    return losses


def _checkpoint_at(saved: Path, iteration: int, load: Path) -> list[str]:
    """``--load`` of a directory holding only ``saved``'s checkpoint of ``iteration``."""
    name = f"iter_{iteration:07d}"
    shutil.copytree(saved / name, load / name)
    (load / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return ["--load", str(load)]


def _after(losses: dict[str, list[tuple[int, float]]], iteration: int) -> dict[str, list[tuple[int, float]]]:
    return {tag: [(i, v) for i, v in values if i > iteration] for tag, values in losses.items()}


def _iterations(values: list[tuple[int, float]]) -> list[int]:
    return [iteration for iteration, _ in values]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """(ours, Megatron-LM's): the losses of each entry point's run of all ITERATIONS, saving every SAVED_AT,
    and the directory of its checkpoints."""
    workdir = tmp_path_factory.mktemp("entry-points")
    runs = []
    for name, entry in (("ours", _ours), ("megatron-lm", _megatron_lms)):
        saved = workdir / name / "saved"
        runs.append((_train(workdir / name, entry, ["--save", str(saved), "--save-interval", str(SAVED_AT)]), saved))
    return runs


def test_the_same_flags_train_the_same_losses_through_both_entry_points(uninterrupted):
    (ours, _), (megatron_lms, _) = uninterrupted
    assert _iterations(ours["lm loss"]) == list(range(1, ITERATIONS + 1)), ours
    # at 4 and 8 in the loop, then the final validation and test losses
    assert _iterations(ours["lm loss validation"]) == [SAVED_AT, ITERATIONS, ITERATIONS, ITERATIONS], ours
    assert ours["lm loss"][-1][1] < ours["lm loss"][0][1] - 0.1, ours  # it trains
    assert ours == megatron_lms


def _entries(value, key: str = ""):
    """(path, leaf) of everything in a loaded checkpoint, megatron's saved arguments field by field."""
    if isinstance(value, argparse.Namespace):
        value = vars(value)
    if isinstance(value, dict):
        for name, item in value.items():
            yield from _entries(item, f"{key}/{name}")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _entries(item, f"{key}/{index}")
    else:
        yield key, value


def _checkpoint(saved: Path, iteration: int, into: Path) -> dict:
    """path -> leaf of ``saved``'s torch_dist checkpoint of ``iteration``, every shard gathered."""
    dcp_to_torch_save(saved / f"iter_{iteration:07d}", into)
    return dict(_entries(torch.load(into, weights_only=False)))


def _same(a, b) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, numpy.ndarray):
        return isinstance(b, numpy.ndarray) and numpy.array_equal(a, b)
    return type(a) is type(b) and a == b


def test_both_entry_points_save_the_same_checkpoint(uninterrupted, tmp_path):
    """The last checkpoints of the two runs, entry for entry: parameters, the distributed optimizer's
    state, the RNG and rerun states, and megatron's saved arguments, which differ only in the run's own
    directories (so ``--model gpt-tiny`` parsed to the arguments its flags give)."""
    (_, ours), (_, megatron_lms) = uninterrupted
    ours = _checkpoint(ours, ITERATIONS, tmp_path / "ours.pt")
    megatron_lms = _checkpoint(megatron_lms, ITERATIONS, tmp_path / "megatron-lm.pt")
    assert sorted(ours) == sorted(megatron_lms)
    assert sum(torch.is_tensor(value) for value in ours.values()) > 20, sorted(ours)
    differing = [key.split("/")[-2:] for key in ours if not _same(ours[key], megatron_lms[key])]
    assert sorted(differing) == [["args", "data_cache_path"], ["args", "save"], ["args", "tensorboard_dir"]]


@pytest.mark.parametrize("saver, loader", [("ours", "megatron-lm"), ("megatron-lm", "ours")])
def test_each_resumes_the_others_checkpoint_on_the_curve_it_was_saved_on(uninterrupted, tmp_path, saver, loader):
    """``loader`` from ``saver``'s iteration-SAVED_AT checkpoint: the losses of ``saver``'s uninterrupted
    run after it, to the bit."""
    by_name = dict(zip(("ours", "megatron-lm"), uninterrupted))
    full, saved = by_name[saver]
    load = _checkpoint_at(saved, SAVED_AT, tmp_path / "load")
    resumed = _train(tmp_path / loader, {"ours": _ours, "megatron-lm": _megatron_lms}[loader], load)
    assert _iterations(resumed["lm loss"]) == list(range(SAVED_AT + 1, ITERATIONS + 1)), resumed
    assert resumed == _after(full, SAVED_AT)

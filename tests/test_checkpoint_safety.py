"""Checkpoints that are never lost, saves whose failure stops every rank, and saves that hold what the
model trains, in the one flow (scripts/pretrain_gpt.py: megatron.training's pretrain and ``save_checkpoint``,
published by adapter/checkpoint_publish.py) on 2 gloo ranks (data parallel 2, the distributed optimizer).

tests/test_megatron_training_save.py kills megatron's re-save of a checkpoint after the partial copy is
written and after the old copy is moved aside, and fails rank 1's write: those are not repeated here. Here:
the other steps of a re-save a kill can stop at, within a run (a finished job started again), a killed
re-save that the next start resumes on the loss curve, a publish failing on rank 0, and the saved weights
under a deferred parameter all-gather."""

from __future__ import annotations

import errno
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from adapter import checkpoint_dir
from adapter.checkpoint_dir import TRACKER, is_complete
from models.verify import hf_logits
from tests.distributed import ROOT, RankFailure, launch_ranks, run_ranks
from tests.flow_ranks import after, fail_in, logged_losses, run_pretrain, stopped_at

pytestmark = [pytest.mark.multiproc, pytest.mark.slow, pytest.mark.megatron_training]


def _argv(iters: int, *extra) -> list[str]:
    return ["--model", "qwen2.5-tiny", "--micro-batch-size", "2", "--global-batch-size", "8", "--seq-length", "32",
            "--train-iters", str(iters), "--lr", "3e-3", "--lr-warmup-iters", "2", "--mock-data", "--log-interval",
            "1", "--eval-interval", "1000", "--eval-iters", "0", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--use-distributed-optimizer", "--ddp-bucket-size", "4096", "--seed", "7", *map(str, extra)]


def _kills(iteration: int) -> dict:
    """step of a save (what has just happened when rank 0 kills every rank) -> (what it wraps, when)."""
    from megatron.training import checkpointing

    name = checkpoint_dir.checkpoint_name(iteration)
    writing = (checkpointing.dist_checkpointing, "save", lambda state, directory, *a: name in str(directory))
    return {"partial made": (*writing, "before"), "partial written": (*writing, "after"),
            "old copy moved aside": (checkpoint_dir.os, "rename", lambda src, dst: Path(src).name == name, "after"),
            "new copy moved in": (checkpoint_dir.os, "rename", lambda src, dst: Path(dst).name == name, "after"),
            "tracker replaced": (checkpoint_dir.os, "replace", lambda src, dst: Path(dst).name == TRACKER and
                                 Path(dst).read_text() == str(iteration), "after")}


def pretrain_killed_at(argv: list[str], iteration: int, step: str, pid_dir: str) -> dict:
    """run_pretrain, but when the save of ``iteration`` reaches ``step`` (rank 0 watching) every rank's process
    is SIGKILLed, as a node failure or a job scheduler would."""
    Path(pid_dir, f"rank{os.environ['RANK']}").write_text(str(os.getpid()))
    if os.environ["RANK"] == "0":
        owner, attribute, matches, when = _kills(iteration)[step]
        after(owner, attribute, matches, when, pid_dir)
    return run_pretrain(argv)


def pretrain_failing_to_publish(argv: list[str], iteration: int) -> dict:
    """run_pretrain, rank 0 not allowed to rename the written checkpoint of ``iteration`` into place (the
    other rank then waits in megatron's closing barrier)."""
    if os.environ["RANK"] == "0":
        name = checkpoint_dir.checkpoint_name(iteration)
        fail_in(checkpoint_dir.os, "rename", lambda src, dst: Path(dst).name == name,
                PermissionError(errno.EACCES, "Permission denied"))
    return run_pretrain(argv)


def _pid_dir(tmp_path) -> str:
    (tmp_path / "pids").mkdir()
    return str(tmp_path / "pids")


def _leftovers(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(".iter_"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """9 iterations saved every 3: the uninterrupted curve and its checkpoints."""
    directory = tmp_path_factory.mktemp("reference")
    return logged_losses(run_ranks(2, run_pretrain, _argv(9, "--save", directory, "--save-interval", 3))), directory


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished job's checkpoints: 5 iterations, saved at 3 and (the last, not a multiple of 3) at 5."""
    directory = tmp_path_factory.mktemp("finished")
    run_ranks(2, run_pretrain, _argv(5, "--save", directory, "--save-interval", 3))
    assert (directory / TRACKER).read_text() == "5"
    return directory


# "partial written" and "old copy moved aside": tests/test_megatron_training_save.py
@pytest.mark.parametrize("step", ["partial made", "new copy moved in", "tracker replaced"])
def test_a_finished_job_started_again_and_killed_in_its_resave_still_loads(finished, tmp_path, step):
    """The same command again loads iteration 5 and megatron saves it again at the end; every process is
    killed at ``step`` of that save. The next start loads a complete iteration 5 (the old copy or the new),
    never trains from scratch, and leaves nothing half done."""
    directory = tmp_path / "checkpoints"
    shutil.copytree(finished, directory)
    again = _argv(5, "--save", directory, "--load", directory, "--save-interval", 3)
    with pytest.raises(RankFailure):
        run_ranks(2, pretrain_killed_at, again, 5, step, _pid_dir(tmp_path))
    restarted = run_ranks(2, run_pretrain, again)
    assert re.search(rf"successfully loaded checkpoint from {directory} .*at iteration 5\b", restarted[0]["stdout"])
    assert [r["train"] for r in restarted] == [[], []]  # loaded, not trained from scratch
    assert (directory / TRACKER).read_text() == "5" and is_complete(directory / "iter_0000005")
    assert _leftovers(directory) == []


@pytest.mark.parametrize("step, resumed_from", [("old copy moved aside", 3), ("tracker replaced", 6)])
def test_a_resave_killed_midway_resumes_the_loss_curve(reference, tmp_path, step, resumed_from):
    """Iteration 6 exists and the tracker is rolled back to 3 (as after a loss spike); the resumed run
    saves 6 again and is killed at ``step``. The next start resumes from 3 or 6 and continues the
    uninterrupted curve exactly."""
    curve, saved = reference
    directory = stopped_at(saved, 3, tmp_path / "checkpoints")
    shutil.copytree(saved / "iter_0000006", directory / "iter_0000006")
    common = ("--save", directory, "--load", directory, "--save-interval", 3)
    with pytest.raises(RankFailure):
        run_ranks(2, pretrain_killed_at, _argv(9, *common), 6, step, _pid_dir(tmp_path))
    resumed = logged_losses(run_ranks(2, run_pretrain, _argv(9, *common)))
    assert resumed == {i: curve[i] for i in range(resumed_from + 1, 10)}
    assert (directory / TRACKER).read_text() == "9" and _leftovers(directory) == []


# rank 1 failing to write: tests/test_megatron_training_save.py
def test_a_publish_failing_on_rank_0_stops_every_rank_with_that_error(tmp_path):
    """Saved at 2; rank 0 may not rename the written checkpoint of 4 into place. Every rank exits non-zero,
    saying the error, within seconds of each other (well inside the 1-minute distributed timeout);
    iteration 2 stays published."""
    ranks = launch_ranks(2, pretrain_failing_to_publish, _argv(4, "--save", tmp_path, "--save-interval", 2,
                                                               "--distributed-timeout-minutes", 1), 4, timeout=300)
    logs = "\n".join(r["log"][-2000:] for r in ranks)
    assert all(r["status"] not in (0, None) for r in ranks), logs
    assert all(f"saving iteration 4 to {tmp_path} failed on rank 0" in r["log"] and "Permission denied" in r["log"]
               for r in ranks), logs
    seconds = [r["seconds"] for r in ranks]
    assert max(seconds) - min(seconds) < 30, seconds
    assert (tmp_path / TRACKER).read_text() == "2" and is_complete(tmp_path / "iter_0000002")
    assert not (tmp_path / "iter_0000004").exists()


def pretrain_and_compare_with_saved(argv: list[str], tokens: torch.Tensor) -> dict:
    """Train (and save at the end), then compare this rank's live parameters, as the next forward uses them,
    with the checkpoint's. Also returns whether, right after the last optimizer step, the parameters were
    not yet all fresh (the deferred all-gather the save must not miss), and the live logits for ``tokens``."""
    from megatron.training import get_args, training

    from models.verify import megatron_logits

    chunks, stale = [], {}
    setup, step = training.setup_model_and_optimizer, training.train_step

    def kept_setup(*args, **kwargs):
        built = setup(*args, **kwargs)
        chunks.extend(built[0])
        return built

    def snapshot_step(*args, **kwargs):
        result = step(*args, **kwargs)
        stale.update(_parameters(chunks))
        return result

    training.setup_model_and_optimizer, training.train_step = kept_setup, snapshot_step
    run_pretrain(argv, keep_group=True)
    logits = megatron_logits(chunks, tokens, get_args())  # the next forward: its hooks gather all
    live, saved = _parameters(chunks), _saved_parameters(chunks, get_args().save)
    torch.distributed.destroy_process_group()
    return {"saved equals live": {str(key): torch.equal(saved[key], t) for key, t in live.items()},
            "stale after the step": any(not torch.equal(stale[key], t) for key, t in live.items()),
            "logits": logits}


def _sharded_tensors(chunks: list) -> list:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    sharded = chunks[0].module.sharded_state_dict()
    apply_factories(sharded)
    return [t for t in nested_values(sharded) if isinstance(t, ShardedTensor)]


def _parameters(chunks: list) -> dict[tuple, torch.Tensor]:
    """(checkpoint key, offset) -> a copy of this rank's tensor there (whole layers at TP 1 x PP 1)."""
    return {(t.key, t.global_offset): t.data.detach().clone() for t in _sharded_tensors(chunks)}


def _saved_parameters(chunks: list, save: str) -> dict[tuple, torch.Tensor]:
    """(checkpoint key, offset) -> the saved tensor of this rank's region there."""
    from models import torch_dist_io

    tensors = _sharded_tensors(chunks)
    reader = torch_dist_io.checkpoint_reader(checkpoint_dir.iteration_dir(save))
    whole = torch_dist_io.read_regions(reader, {t.key: ((0,) * len(t.global_shape), tuple(t.global_shape), t.dtype)
                                                for t in tensors})
    return {(t.key, t.global_offset): whole[t.key][tuple(slice(o, o + n) for o, n in zip(
        t.global_offset, (1,) * t.prepend_axis_num + tuple(t.local_shape)))].reshape(t.data.shape) for t in tensors}


def test_overlapped_param_gather_saves_the_weights_the_model_trains(tmp_path):
    """DP2, the distributed optimizer with overlapped parameter all-gather (megatron asks for overlapped
    gradient reduction with it): each rank's fresh shard is
    gathered only in the next forward, yet the saved weights equal the live ones, and the Hugging Face
    model converted from the checkpoint gives the live model's logits."""
    tokens = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(7))
    save = tmp_path / "checkpoints"
    argv = _argv(4, "--overlap-param-gather", "--overlap-grad-reduce", "--save", save, "--save-interval", 1000)
    ranks = run_ranks(2, pretrain_and_compare_with_saved, argv, tokens)
    assert any(r["stale after the step"] for r in ranks)  # the all-gather was deferred indeed
    for r in ranks:
        assert r["saved equals live"] and all(r["saved equals live"].values()), r["saved equals live"]
    converted = subprocess.run([sys.executable, "scripts/convert_checkpoint.py", "mcore-to-hf", "--load-dir",
                                str(save), "--save-dir", str(tmp_path / "hf"), "--model", "qwen2.5-tiny",
                                "--no-progress"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert converted.returncode == 0, converted.stderr
    hf = hf_logits(str(tmp_path / "hf"), tokens)
    torch.testing.assert_close(ranks[0]["logits"], hf, rtol=0, atol=1e-4)

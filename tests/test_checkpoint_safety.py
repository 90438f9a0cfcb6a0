"""Checkpoints that are never lost, saves whose failure stops every rank, and saves that hold what the
model trains, on 2 gloo ranks (data parallel 2, the distributed optimizer)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch

from adapter.checkpoint_dir import TRACKER, is_complete
from models.verify import hf_logits
from tests.distributed import ROOT, RankFailure, launch_ranks, run_ranks
from tests.pretrain_ranks import (KILL_STEPS, run_pretrain, run_pretrain_and_compare_with_saved,
                                  run_pretrain_failing, run_pretrain_killed_at, stopped_at)

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]


def _argv(iters: int, *extra) -> list[str]:
    return ["--model", "qwen2.5-tiny", "--micro-batch-size", "2", "--global-batch-size", "8", "--seq-length", "32",
            "--train-iters", str(iters), "--lr", "3e-3", "--lr-warmup-iters", "2", "--mock-data", "--log-interval",
            "1", "--eval-iters", "0", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--use-distributed-optimizer", "--ddp-bucket-size", "4096", "--seed", "7", *map(str, extra)]


def _losses(results: list[dict]) -> dict[int, float]:
    return {entry["iteration"]: entry["lm loss"] for r in results for entry in r["train"] if "lm loss" in entry}


def _pid_dir(tmp_path) -> str:
    (tmp_path / "pids").mkdir()
    return str(tmp_path / "pids")


def _leftovers(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(".iter_"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """9 iterations saved every 3: the uninterrupted curve and its checkpoints."""
    directory = tmp_path_factory.mktemp("reference")
    return _losses(run_ranks(2, run_pretrain, _argv(9, "--save", directory, "--save-interval", 3))), directory


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished job's checkpoints: 5 iterations, saved at 3 and (the last, not a multiple of 3) at 5."""
    directory = tmp_path_factory.mktemp("finished")
    run_ranks(2, run_pretrain, _argv(5, "--save", directory, "--save-interval", 3))
    assert (directory / TRACKER).read_text() == "5"
    return directory


@pytest.mark.parametrize("step", KILL_STEPS)
def test_a_finished_job_started_again_and_killed_in_its_resave_still_loads(finished, tmp_path, step):
    """The same command again loads iteration 5 and saves it again at the end; every process is killed at
    ``step`` of that save. The next start loads a complete iteration 5 (the old copy or the new), never
    trains from scratch, and leaves nothing half done."""
    directory = tmp_path / "checkpoints"
    shutil.copytree(finished, directory)
    again = _argv(5, "--save", directory, "--load", directory, "--save-interval", 3)
    with pytest.raises(RankFailure):
        run_ranks(2, run_pretrain_killed_at, again, 5, step, _pid_dir(tmp_path))
    restarted = run_ranks(2, run_pretrain, again)
    assert [r["iteration"] for r in restarted] == [5, 5]
    assert _losses(restarted) == {}  # loaded, not trained from scratch
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
        run_ranks(2, run_pretrain_killed_at, _argv(9, *common), 6, step, _pid_dir(tmp_path))
    resumed = _losses(run_ranks(2, run_pretrain, _argv(9, *common)))
    assert resumed == {i: curve[i] for i in range(resumed_from + 1, 10)}
    assert (directory / TRACKER).read_text() == "9" and _leftovers(directory) == []


@pytest.mark.parametrize("failure, error", [("rank 1 cannot write", "No space left on device"),
                                            ("rank 0 cannot publish", "Permission denied")])
def test_a_save_failing_on_one_rank_stops_every_rank_with_that_error(tmp_path, failure, error):
    """Saved at 2; the save of 4 fails on one rank. Every rank exits non-zero, saying the error, within
    seconds of each other (well inside the 1-minute distributed timeout); iteration 2 stays published."""
    ranks = launch_ranks(2, run_pretrain_failing, _argv(4, "--save", tmp_path, "--save-interval", 2,
                                                         "--distributed-timeout-minutes", 1), 4, failure,
                         timeout=300)
    logs = "\n".join(r["log"][-2000:] for r in ranks)
    assert all(r["status"] not in (0, None) for r in ranks), logs
    assert all(f"saving iteration 4 to {tmp_path} failed on rank" in r["log"] and error in r["log"]
               for r in ranks), logs
    seconds = [r["seconds"] for r in ranks]
    assert max(seconds) - min(seconds) < 30, seconds
    assert (tmp_path / TRACKER).read_text() == "2" and is_complete(tmp_path / "iter_0000002")
    assert not (tmp_path / "iter_0000004").exists()


def test_overlapped_param_gather_saves_the_weights_the_model_trains(tmp_path):
    """DP2, the distributed optimizer with overlapped parameter all-gather: each rank's fresh shard is
    gathered only in the next forward, yet the saved weights equal the live ones, and the Hugging Face
    model converted from the checkpoint gives the live model's logits."""
    tokens = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(7))
    save = tmp_path / "checkpoints"
    ranks = run_ranks(2, run_pretrain_and_compare_with_saved,
                      _argv(4, "--overlap-param-gather", "--save", save), tokens)
    assert any(r["stale after the step"] for r in ranks)  # the all-gather was deferred indeed
    for r in ranks:
        assert r["saved equals live"] and all(r["saved equals live"].values()), r["saved equals live"]
    converted = subprocess.run([sys.executable, "scripts/convert_checkpoint.py", "mcore-to-hf", "--load-dir",
                                str(save), "--save-dir", str(tmp_path / "hf"), "--model", "qwen2.5-tiny",
                                "--no-progress"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert converted.returncode == 0, converted.stderr
    hf = hf_logits(str(tmp_path / "hf"), tokens)
    torch.testing.assert_close(ranks[0]["logits"], hf, rtol=0, atol=1e-4)

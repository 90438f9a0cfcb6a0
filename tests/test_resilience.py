"""Preemption and non-finite steps on gloo ranks through scripts/pretrain_gpt.py (megatron.training's
pretrain): --exit-signal-handler (patches/early_exit.py), --exit-duration-in-mins, non-finite steps.

Preemption: SIGTERM to the launcher only, or to every process of the job as a scheduler sends it; every rank
finishes its iteration, the flow saves it, the job exits 0 (scripts/launch.py; plain torchrun exits 1), and the
next launch continues an uninterrupted run's loss curve exactly. --exit-duration-in-mins leaves with a
checkpoint. Non-finite steps: a NaN loss stops the run with one line naming the iteration, the rank and the
value, after megatron's rerun state machine re-ran the step, exit 16 where megatron saved its re-run checkpoint
and 17 otherwise, and nothing is saved after the last finite iteration (the files on disk)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading

import pytest

from adapter import checkpoint_dir
from tests.distributed import ROOT, _base_env, free_port, launch_script, run_ranks
from tests.flow_ranks import logged_losses, run_pretrain

pytestmark = [pytest.mark.multiproc, pytest.mark.slow, pytest.mark.megatron_training]


def _argv(*extra: str, lr: str = "3e-3", iters: int = 1000) -> list[str]:
    """Two data-parallel ranks of the tiny model; 1000 iterations set the LR schedule and sample order, and each
    run stops far earlier (--exit-interval, a signal, a NaN)."""
    return ["--model", "qwen2.5-tiny", "--micro-batch-size", "2", "--global-batch-size", "4", "--seq-length", "64",
            "--train-iters", str(iters), "--lr", lr, "--min-lr", "3e-4", "--lr-decay-style", "cosine",
            "--lr-warmup-iters", "2", "--mock-data", "--log-interval", "1", "--eval-iters", "0", "--hidden-dropout",
            "0", "--attention-dropout", "0", "--seed", "7", *extra]


def _saved(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def _flow_argv(*extra: str, lr: str = "3e-3", iters: int = 1000) -> list[str]:
    """``_argv`` for scripts/pretrain_gpt.py, megatron.training's pretrain: the evaluation interval it asks for
    (--model gives the tokenizer and the embedding's rows; a save interval goes with --save)."""
    return _argv("--eval-interval", "1000", *extra, lr=lr, iters=iters)


def _flow_losses(argv: list[str]) -> dict[int, float]:
    """scripts/pretrain_gpt.py on 2 ranks, which must exit 0: iteration -> the loss megatron's log printed."""
    ranks = launch_script("scripts/pretrain_gpt.py", argv)
    output = "".join(output for _, output in ranks)
    assert [status for status, _ in ranks] == [0, 0], output[-4000:]
    return {int(i): float(loss) for i, loss in re.findall(r" iteration +(\d+)/ *\d+ \|.*?\| lm loss: (\S+) \|",
                                                           output)}


@pytest.fixture(scope="module")
def flow_reference() -> dict[int, float]:
    """scripts/pretrain_gpt.py's uninterrupted curve, iterations 1-24."""
    return _flow_losses(_flow_argv("--exit-interval", "24"))


# megatron.training's first torch_dist save takes tens of seconds on a loaded 2-core machine, past torchrun's
# 30-s default: the launcher's shutdown timeout gives it 120, and the test still asserts nothing was SIGKILLed
SHUTDOWN = {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "120"}


def _preempted(save, to_group: bool, launcher: list[str]) -> tuple[int, str, int]:
    """``launcher`` (torchrun's arguments) with 2 workers, SIGTERM once iteration 3 is logged: to the launcher
    only, or to its whole process group. Returns the launcher's exit status, everything printed and its pid."""
    command = [sys.executable, *launcher, "--nproc-per-node", "2", "--master-port", str(free_port()),
               "scripts/pretrain_gpt.py", *_flow_argv("--exit-signal-handler", "--save", str(save),
                                                      "--save-interval", "1000")]
    launcher = subprocess.Popen(command, cwd=ROOT, env=_base_env(SHUTDOWN), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
    # a run that never logs iteration 3 (seen once: both ranks stuck in torch inductor's ISA probe) ends the
    # test at a deadline instead of holding the suite until CI's own limit
    deadline = threading.Timer(600, os.killpg, (launcher.pid, signal.SIGKILL))
    deadline.start()
    printed = []
    try:
        for line in launcher.stdout:
            printed.append(line)
            if " iteration        3/" in line:
                (os.killpg if to_group else os.kill)(launcher.pid, signal.SIGTERM)
                break
        printed.append(launcher.communicate(timeout=300)[0])
    finally:
        deadline.cancel()
    return launcher.returncode, "".join(printed), launcher.pid


def _stopped_at(output: str, save) -> int:
    """The iteration the one ``stopped after`` line names; the checkpoint directory holds it alone."""
    stopped = [line for line in output.splitlines() if "[adapter] stopped after iteration" in line]
    assert len(stopped) == 1, output[-4000:]
    iteration = int(stopped[0].split("stopped after iteration ")[1].split(":")[0])
    assert stopped[0].endswith(f"{iteration}: SIGTERM received; saved in {save}, resume with --load")
    assert 3 <= iteration <= 12, output[-4000:]
    assert _saved(save) == [checkpoint_dir.checkpoint_name(iteration), checkpoint_dir.TRACKER]
    # the workers ended within the launcher's --shutdown-timeout, no SIGKILL
    assert "forcefully exiting via" not in output, output[-4000:]
    return iteration


@pytest.mark.parametrize("to_group", [False, True], ids=["to the launcher only", "to every process"])
def test_sigterm_saves_the_iteration_every_rank_finished_the_job_exits_0_and_the_next_launch_resumes_exactly(
        flow_reference, tmp_path, to_group):
    """megatron.training's --exit-signal-handler, with the adapter's line (patches/early_exit.py). The resume
    runs once, after the signal to every process: the checkpoint of either delivery is megatron's same save at
    the end of an iteration (the suite resumed both, 35-40 s more)."""
    status, output, _ = _preempted(tmp_path / "saved", to_group, ["scripts/launch.py"])
    iteration = _stopped_at(output, tmp_path / "saved")
    assert status == 0 and "Traceback" not in output, output[-4000:]
    assert "[launch] SIGTERM: every worker saved and exited 0" in output
    if not to_group:
        return
    resumed = _flow_losses(_flow_argv("--load", str(tmp_path / "saved"), "--exit-interval", str(iteration + 3)))
    # megatron.training's log line for the second iteration after a --load (0.19.2) shows the mean of the first
    # two iterations' losses (resumed at 5: 6.627220 = (6.653440 + 6.601000) / 2, the same gradient norm)
    first, second, third = (flow_reference[i] for i in range(iteration + 1, iteration + 4))
    assert sorted(resumed) == [iteration + 1, iteration + 2, iteration + 3]
    assert [resumed[iteration + 1], resumed[iteration + 3]] == [first, third]
    assert resumed[iteration + 2] == pytest.approx((first + second) / 2, abs=2e-6)


def test_plain_torchrun_saves_as_well_but_exits_1(tmp_path):
    """What scripts/launch.py is for: torchrun (torch 2.13) raises the signal it received as a SignalException,
    its one traceback, and exits 1 whatever its workers did."""
    status, output, pid = _preempted(tmp_path / "saved", False, ["-m", "torch.distributed.run"])
    _stopped_at(output, tmp_path / "saved")
    assert status == 1 and output.count("Traceback") == 1, output[-4000:]
    assert output.rstrip().endswith("SignalException: Process " + str(pid) + " got signal: 15"), output[-4000:]


def _budgeted(save) -> list[str]:
    """A run given a minute (megatron's budget is whole minutes) from its processes' start, saved where it
    stops. 16 micro-batches a rank in each iteration, so that tens of iterations fit in the minute, not
    hundreds: the run never reaches --train-iters on a fast machine, and the uninterrupted run the resume is
    compared with stays short on a slow one."""
    return _flow_argv("--exit-duration-in-mins", "1", "--save", str(save), "--save-interval", "1000",
                      "--global-batch-size", "64")


def test_the_time_budget_saves_and_leaves_says_why_in_one_line_and_the_next_launch_resumes_exactly(tmp_path):
    """megatron.training's --exit-duration-in-mins, from the launched processes' start: once an iteration ends
    past it, every rank saves that iteration and the job exits 0, rank 0 saying so in patches/early_exit.py's
    line (the iteration, the minutes and the budget, where it is saved). megatron leaves after the first
    iteration that ends past the budget (Megatron-LM's meaning of the flag, kept; the project's earlier loop
    left before one would end past it). How many iterations fit depends on the machine; the resumed
    iterations are compared, as each step reduced its loss, with a run never stopped."""
    # a minute of training after start-up, which takes minutes on a loaded 2-core CI host (300 s ran out there)
    ranks = launch_script("scripts/pretrain_gpt.py", _budgeted(tmp_path), timeout=900)
    output = "".join(output for _, output in ranks)
    assert [status for status, _ in ranks] == [0, 0], output[-4000:]
    spent = re.findall(r"exiting program after ([0-9.]+) minutes", output)
    assert spent and float(spent[0]) > 1, output[-4000:]
    iteration = int((tmp_path / checkpoint_dir.TRACKER).read_text())
    assert 1 <= iteration < 1000
    assert _saved(tmp_path) == [checkpoint_dir.checkpoint_name(iteration), checkpoint_dir.TRACKER]
    [line] = [line for line in ranks[0][1].splitlines() if "[adapter] stopped after iteration" in line]
    assert re.fullmatch(rf"\[adapter\] stopped after iteration {iteration}: [0-9.]+ minutes after the launch, past "
                        rf"--exit-duration-in-mins 1; saved in {tmp_path}, resume with --load", line), line
    end = ("--exit-interval", str(iteration + 3), "--global-batch-size", "64")
    resumed = logged_losses(run_ranks(2, run_pretrain, _flow_argv("--load", str(tmp_path), *end)))
    uninterrupted = logged_losses(run_ranks(2, run_pretrain, _flow_argv(*end)))
    assert resumed == {i: uninterrupted[i] for i in range(iteration + 1, iteration + 4)}


FOUND = "error: iteration 3: the loss is nan on rank 0 (found NaN in local forward loss calculation); "
NAN_STOPS = {  # patches/nonfinite.py: the line and every rank's exit status
    "validate_results": (FOUND + "a re-run gave it again: the training diverged (lower --lr, now 1e+12) or this "
                         "device is faulty. Megatron-LM saved iteration 2 to {save} with its re-run state: loaded on "
                         "another device it re-runs iteration 3 to tell which (on this one it exits 16 again); to "
                         "train on, resume from a checkpoint saved before the loss diverged", 16),
    "disabled": (FOUND + "--rerun-mode disabled: not re-run. Nothing was saved after iteration 2: lower --lr (now "
                 "1e+12) and resume from the last checkpoint", 17),
    # report_stats re-runs every step and rejects nothing: the optimizer's gradient norm stops it
    "report_stats": ("error: iteration 3: the gradient norm is nan and the optimizer stepped with it; nothing was "
                     "saved after iteration 2: lower --lr (now 1e+12) and resume from the last checkpoint", 17),
}


@pytest.mark.parametrize("mode, world", [("validate_results", 2), ("disabled", 1), ("report_stats", 1)])
def test_a_nan_loss_stops_the_run_with_one_line_and_saves_nothing_after_it(tmp_path, mode, world):
    """--lr 1e12 (after 2 warm-up iterations): iterations 1 and 2 are finite and saved, their steps make the loss
    NaN at iteration 3. megatron's machine re-runs it (validate_results) and saves iteration 2 again with its
    re-run state, exit 16; the other modes save nothing more, exit 17."""
    argv = _flow_argv("--rerun-mode", mode, "--save", tmp_path, "--save-interval", "1", lr="1e12", iters=6)
    ranks = launch_script("scripts/pretrain_gpt.py", argv, world_size=world)
    output = "".join(output for _, output in ranks)
    line, status = NAN_STOPS[mode]
    assert [status for status, _ in ranks] == [status] * world, output[-4000:]
    assert [line for line in output.splitlines() if "error:" in line] == [line.format(save=tmp_path)], \
        output[-4000:]
    assert "Traceback" not in output
    assert ("Need to rerun step to check reproducibility" in output) == (mode == "validate_results")
    assert _saved(tmp_path) == [checkpoint_dir.checkpoint_name(1), checkpoint_dir.checkpoint_name(2),
                                checkpoint_dir.TRACKER]
    assert (tmp_path / checkpoint_dir.TRACKER).read_text() == "2"


def test_a_transient_nan_is_rerun_then_stops_and_the_next_launch_resumes_exactly(flow_reference, tmp_path):
    """megatron's error injector rejects iteration 2's first loss check on each rank; the re-run does not
    reproduce it, and megatron's machine stops the run on a fatal check even so (exit 17, Megatron-LM's
    "resume from a previous checkpoint"). The next launch resumes the clean curve from iteration 1's
    checkpoint."""
    argv = _flow_argv("--error-injection-rate", "1", "--save", tmp_path, "--save-interval", "1")
    ranks = launch_script("scripts/pretrain_gpt.py", argv)
    output = "".join(output for _, output in ranks)
    assert [status for status, _ in ranks] == [17, 17], output[-4000:]
    [error] = [line for line in output.splitlines() if "error:" in line]
    assert error.startswith("error: iteration 2: the loss is ")
    assert error.endswith(" on rank 0 (found NaN in local forward loss calculation); a re-run of the step gave "
                          "another result: a transient fault. Nothing was saved after iteration 1: resume from the "
                          "last checkpoint"), error
    assert "Possible transient error!" in output and "Traceback" not in output
    assert _saved(tmp_path) == [checkpoint_dir.checkpoint_name(1), checkpoint_dir.TRACKER]
    resumed = _flow_losses(_flow_argv("--load", tmp_path, "--exit-interval", "5"))
    # megatron.training's second log line of a process is the mean of its first two iterations' losses, the
    # uninterrupted run's as well: its iteration 2 was 2 * flow_reference[2] - flow_reference[1]
    second = 2 * flow_reference[2] - flow_reference[1]
    assert sorted(resumed) == [2, 3, 4, 5]
    assert resumed[2] == pytest.approx(second, abs=2e-6)
    assert resumed[3] == pytest.approx((second + flow_reference[3]) / 2, abs=2e-6)
    assert [resumed[4], resumed[5]] == [flow_reference[4], flow_reference[5]]


def pretrain_noting_reruns(argv: list[str]) -> dict:
    """run_pretrain, with what megatron's rerun state machine logged on this rank under "reruns"."""
    import logging

    noted: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: noted.append(record.getMessage())
    logging.getLogger("megatron.core.rerun_state_machine").addHandler(handler)
    return {**run_pretrain(argv), "reruns": noted}


def test_a_transient_spiky_loss_is_rerun_and_training_continues_on_the_clean_curve():
    """The spiky-loss check is not fatal: each injected rejection (every iteration from the second) is re-run,
    found not reproducible, and training continues with the re-run step: the clean curve, bit for bit (each
    iteration's loss as the step reduced it, in the rank's process)."""
    clean = logged_losses(run_ranks(2, run_pretrain, _flow_argv("--exit-interval", "5")))
    results = run_ranks(2, pretrain_noting_reruns, _flow_argv(
        "--no-check-for-nan-in-loss-and-grad", "--check-for-spiky-loss", "--error-injection-rate", "1",
        "--exit-interval", "5"))
    assert logged_losses(results) == clean and sorted(clean) == [1, 2, 3, 4, 5]
    continued = [m for m in results[0]["reruns"] if m.startswith("Continuing normal execution")]
    assert len(continued) == 4, results[0]["reruns"]

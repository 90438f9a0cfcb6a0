"""scripts/launch.py: torchrun, with a preempted job whose workers saved exiting 0, and torchrun's own ending
otherwise. Workers here are one-line Python processes (``--no-python``), so each case takes seconds; the flow's
own preemption under the launcher is tests/test_resilience.py's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from scripts.launch import exit_signal
from tests.distributed import ROOT, _base_env, free_port

pytestmark = pytest.mark.multiproc

# a worker that, on the exit signal, "saves" and exits with the status given, after saying it is ready
WORKER = ("import signal, sys, time; signal.signal(signal.{sig}, lambda *_: sys.exit({status})); "
          "print('ready', flush=True); time.sleep(120)")


@pytest.mark.parametrize("argv, expected", [
    ([], None),
    (["--lr", "1e-3"], None),
    (["--exit-signal-handler"], signal.SIGTERM),
    (["--exit-signal-handler", "--exit-signal", "SIGUSR1"], signal.SIGUSR1),
    (["--exit-signal=sigusr2", "--exit-signal-handler"], signal.SIGUSR2),
    (["--exit-signal", "SIGUSR1"], None),  # no handler asked for: torchrun's behaviour
])
def test_the_exit_signal_is_read_from_the_flows_arguments(argv, expected):
    assert exit_signal(argv) == expected


def _launch(worker: str, *flow_args: str, send=signal.SIGTERM, nproc: int = 2,
            shutdown_timeout: int = 10) -> tuple[int, str]:
    """The launcher with ``nproc`` workers running ``worker``; ``send`` to the launcher alone once every worker
    is ready. Returns its exit status and output."""
    command = [sys.executable, "scripts/launch.py", "--nproc-per-node", str(nproc), "--master-port",
               str(free_port()), "--max-restarts", "2", "--shutdown-timeout", str(shutdown_timeout), "--no-python",
               sys.executable, "-c", worker, *flow_args]
    launcher = subprocess.Popen(command, cwd=ROOT, env=_base_env(None), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
    printed, ready = [], 0
    for line in launcher.stdout:
        printed.append(line)
        ready += line.count("ready")  # two workers' lines may interleave: "readyready"
        if ready >= nproc:
            os.kill(launcher.pid, send)
            break
    try:
        printed.append(launcher.communicate(timeout=60)[0])
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    return launcher.returncode, "".join(printed)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_workers_that_save_and_exit_0_end_the_job_with_0_and_no_restart(sig):
    flow = ["--exit-signal-handler"] + (["--exit-signal", sig.name] if sig != signal.SIGTERM else [])
    status, output = _launch(WORKER.format(sig=sig.name, status=0), *flow, send=sig)
    assert status == 0, output[-3000:]
    assert f"[launch] {sig.name}: every worker saved and exited 0" in output
    assert "Traceback" not in output and output.count("ready") == 2  # not started again


def test_a_worker_that_fails_on_the_signal_ends_the_job_as_torchrun_would():
    status, output = _launch(WORKER.format(sig="SIGTERM", status=3), "--exit-signal-handler")
    assert status == 1, output[-3000:]
    assert "SignalException" in output and "every worker saved" not in output
    assert output.count("ready") == 2


def test_a_worker_that_outlasts_the_shutdown_timeout_is_killed_and_the_job_fails():
    """A worker still starting (no handler yet) is the same case: it cannot save. It ignores the signal for
    good, so a shutdown timeout of 2 s shows the kill as the others' 10 s would, 8 s sooner."""
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); " \
               "time.sleep(120)"
    status, output = _launch(stubborn, "--exit-signal-handler", nproc=1, shutdown_timeout=2)
    assert status == 1 and "SignalException" in output, output[-3000:]


def _run(worker: str, nproc: int = 2) -> tuple[int, str]:
    """The launcher with ``nproc`` workers running ``worker`` to their end: its exit status and output."""
    command = [sys.executable, "scripts/launch.py", "--nproc-per-node", str(nproc), "--master-port",
               str(free_port()), "--no-python", sys.executable, "-c", worker]
    done = subprocess.run(command, cwd=ROOT, env=_base_env(None), capture_output=True, text=True, timeout=120)
    return done.returncode, done.stdout + done.stderr


# rank 0 says why and exits 2, as the flow does; another refused rank waits for rank 0 to leave first, as
# adapter.run's run_guarded does under torchrun (a fixed 0.2 s head start was not enough for a rank 0 started
# late on a loaded machine: rank 1 exited first and the agent stopped rank 0 before it printed), and the agent
# stops it then
REFUSING = ("import os, sys, time; time.sleep(0 if os.environ['RANK'] == '0' else 60); "
            "print('error: --lr-warmup-iters 20: must be fewer than the 20 decay iterations', file=sys.stderr) "
            "if os.environ['RANK'] == '0' else None; sys.exit(2)")


def test_workers_that_refuse_their_arguments_end_the_job_with_the_line_and_one_of_the_launchers():
    status, output = _run(REFUSING)
    assert status == 2, output[-3000:]
    lines = output.strip().splitlines()
    assert lines[0] == "error: --lr-warmup-iters 20: must be fewer than the 20 decay iterations", output
    assert len(lines) == 2 and lines[1].startswith("[launch] ") and "exited with status 2" in lines[1], output


@pytest.mark.parametrize("worker", [
    # one fails, then one refuses: not a refusal (rank 0 waits, or torchrun may stop rank 1 before it fails)
    "import os, sys, time; r = os.environ['RANK']; r == '0' and time.sleep(10); sys.exit(2 if r == '0' else 1)",
    "raise RuntimeError('boom')",
])
def test_a_worker_that_crashes_keeps_torchruns_full_report(worker):
    status, output = _run(worker)
    assert status == 1, output[-3000:]
    assert "ChildFailedError" in output and "failed (exitcode:" in output and "[launch]" not in output

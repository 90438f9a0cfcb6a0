"""torchrun, except that a preempted job whose workers saved exits 0.

    python scripts/launch.py [torchrun's options] scripts/pretrain_gpt.py [the flow's arguments]

Takes torchrun's arguments and does what torchrun does, with one difference, and only when the training
arguments ask for ``--exit-signal-handler``. torchrun (torch 2.13) meets the signals it handles (SIGTERM among
them) by raising a ``SignalException`` in its agent: it sends the signal on to its workers, waits
``--shutdown-timeout`` seconds, SIGKILLs what is left, and exits 1 with a traceback, whatever the workers did.
A scheduler that preempts the job reads that 1 as a failed job, although every rank finished its iteration,
saved it and exited 0 (adapter/training/preemption.py).

Here the flow's ``--exit-signal`` (SIGTERM by default) is taken off torchrun's ``--signals-to-handle`` and
handled by the launcher: it passes the signal to its workers and waits, within the same shutdown timeout, for
them to leave. When every worker exits 0 the agent finds them done, as after a finished run (its restarts are
for failures), and the job exits 0. Otherwise (a worker still starting, which cannot save, or one that failed
or outlasted the timeout) what is left is SIGKILLed and the launcher raises torchrun's own ``SignalException``,
so the job ends as torchrun would end it. The same holds when the signal reaches every process of the job: each
worker takes it once or twice and stops after the same iteration either way.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import psutil
from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import record

_POLL = 0.1  # seconds between looks at the workers


def exit_signal(training_args: list[str]) -> signal.Signals | None:
    """The signal the flow's ``--exit-signal-handler`` stops on (``--exit-signal``, SIGTERM by default), or
    None without it. A name the flow refuses is left to the flow, which refuses it in one line."""
    if "--exit-signal-handler" not in training_args:
        return None
    name = "SIGTERM"
    for at, arg in enumerate(training_args):
        if arg == "--exit-signal" and at + 1 < len(training_args):
            name = training_args[at + 1]
        elif arg.startswith("--exit-signal="):
            name = arg.partition("=")[2]
    return signal.Signals.__members__.get(name.upper())


class WorkersSave:
    """The launcher's handler of the exit signal (module doc)."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self.busy = False

    def __call__(self, signum: int, frame) -> None:
        if self.busy:  # the same signal again while the workers save: they have it already
            return
        self.busy = True
        workers = psutil.Process().children()
        for worker in workers:
            _send(worker, signum)
        codes = exit_codes([w.pid for w in workers], self.timeout)
        if workers and all(codes.get(w.pid) == 0 for w in workers):
            print(f"[launch] {signal.Signals(signum).name}: every worker saved and exited 0", file=sys.stderr,
                  flush=True)
            self.busy = False
            return  # the agent reaps them (their statuses are still there to read) and ends the job with 0
        for worker in workers:
            if worker.pid not in codes:
                _send(worker, signal.SIGKILL)
        raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))


def _send(worker: psutil.Process, signum: int) -> None:
    try:
        worker.send_signal(signum)
    except psutil.NoSuchProcess:
        pass


def exit_codes(pids: list[int], timeout: float) -> dict[int, int | None]:
    """pid -> exit status (minus the signal that ended it; None where it is unknown) for each child that ended
    within ``timeout`` seconds. The children are not reaped (``WNOWAIT``): torchrun's agent reads the same
    statuses afterwards, as it would have."""
    deadline = time.monotonic() + timeout
    codes: dict[int, int | None] = {}
    while True:
        for pid in set(pids) - codes.keys():
            try:
                info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:  # reaped already by the agent: its status is the agent's to know
                codes[pid] = None
                continue
            if info is not None:
                codes[pid] = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
        if len(codes) == len(set(pids)) or time.monotonic() > deadline:
            return codes
        time.sleep(_POLL)


@record  # as torchrun's main: a failed worker's error file becomes the launcher's
def main(argv: list[str] | None = None) -> None:
    args = torchrun.parse_args(sys.argv[1:] if argv is None else argv)
    stop_on = exit_signal(args.training_script_args)
    if stop_on is not None and hasattr(args, "signals_to_handle"):  # older torch: torchrun's handling alone
        handled = [name.strip() for name in args.signals_to_handle.split(",")]
        args.signals_to_handle = ",".join(name for name in handled if name.upper() != stop_on.name)
        # torchrun's own default for --shutdown-timeout
        timeout = getattr(args, "shutdown_timeout", None)
        timeout = int(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30")) if timeout is None else timeout
        signal.signal(stop_on, WorkersSave(float(timeout)))
    torchrun.run(args)


if __name__ == "__main__":
    main()

"""torchrun, except that a preempted job whose workers saved exits 0.

    python scripts/launch.py [torchrun's options] scripts/pretrain_gpt.py [the flow's arguments]

Takes torchrun's arguments and does what torchrun does, with one difference, and only when the training
arguments ask for ``--exit-signal-handler``. torchrun (torch 2.13) meets the signals it handles (SIGTERM among
them) by raising a ``SignalException`` in its agent: it sends the signal on to its workers, waits
``--shutdown-timeout`` seconds, SIGKILLs what is left, and exits 1 with a traceback, whatever the workers did.
A scheduler that preempts the job reads that 1 as a failed job, although every rank finished its iteration,
saved it and exited 0 (megatron.training's ``--exit-signal-handler``, patches/early_exit.py).

Here the flow's ``--exit-signal`` (SIGTERM by default) is taken off torchrun's ``--signals-to-handle`` and
handled by the launcher: it passes the signal to its workers and waits, within the same shutdown timeout, for
them to leave. When every worker exits 0 the agent finds them done, as after a finished run (its restarts are
for failures), and the job exits 0. Otherwise (a worker still starting, which cannot save, or one that failed
or outlasted the timeout) what is left is SIGKILLed and the launcher raises torchrun's own ``SignalException``,
so the job ends as torchrun would end it. The same holds when the signal reaches every process of the job: each
worker takes it once or twice and stops after the same iteration either way.

Arguments the flow refuses. Every worker refuses them the same way: one line (``error: ...``, from rank 0) and
exit status 2, as argparse does. torchrun reads that as a failed job and buries the line under its own
``ChildFailedError`` traceback and failure table. So when the first worker to fail exited 2 and every other one
either exited 2 or was stopped by the agent's signal, the launcher says so in one line (``[launch] workers 0, 1
exited with status 2 ...``) and exits 2 itself. Any other ending (a worker that crashed, was killed, exited 1)
keeps torchrun's full report, including its log line naming the first failure, which the launcher holds back
only until it knows which ending it is.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

import psutil
from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record

_POLL = 0.1  # seconds between looks at the workers
REFUSED = 2  # a worker's exit status for arguments it refuses (the flow's, argparse's)
_AGENT_LOG = "torch.distributed.elastic.multiprocessing.api"  # logs "failed (exitcode: N) local_rank: ..."


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


class HeldFailures(logging.Filter):
    """Holds back the agent's log lines of a failed round (the signals it sends the workers left, its line
    naming the first failure) while that failure may be a refusal (module doc); ``release`` logs what was
    held, where the job's ending turns out to be another."""

    def __init__(self):
        super().__init__()
        self.held: list[logging.LogRecord] = []

    def filter(self, entry: logging.LogRecord) -> bool:
        failed = entry.msg.startswith("failed (exitcode")
        if failed and entry.args and entry.args[0] != REFUSED:
            self.held.append(entry)
            self.release(logging.getLogger(entry.name))
            return False
        if failed or entry.msg.startswith("Sending process"):
            self.held.append(entry)
            return False
        return True

    def release(self, logger: logging.Logger) -> None:
        """Log what was held, in its order, and hold nothing more."""
        logger.removeFilter(self)
        held, self.held = self.held, []
        for entry in held:
            logger.handle(entry)


def refused(failed: ChildFailedError) -> str | None:
    """The launcher's line when the workers refused their arguments (module doc), else None."""
    first, failure = failed.get_first_failure()
    if failure.exitcode != REFUSED:
        return None
    codes = {rank: f.exitcode for rank, f in sorted(failed.failures.items())}
    if any(code != REFUSED and code >= 0 for code in codes.values()):
        return None
    said = [f"{_ranks([r for r, c in codes.items() if c == REFUSED])} exited with status {REFUSED} (arguments "
            f"refused)"]
    for code in sorted({c for c in codes.values() if c < 0}):
        said.append(f"{_ranks([r for r, c in codes.items() if c == code])} stopped by the launcher "
                    f"({signal.Signals(-code).name})")
    return f"[launch] {failed.name}: " + "; ".join(said)


def _ranks(ranks: list[int]) -> str:
    return f"worker{'s' if len(ranks) != 1 else ''} {', '.join(map(str, ranks))}"


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
    agent_log, held = logging.getLogger(_AGENT_LOG), HeldFailures()
    agent_log.addFilter(held)
    try:
        torchrun.run(args)
    except ChildFailedError as failed:
        line = refused(failed)
        if line is None:
            held.release(agent_log)
            raise
        print(line, file=sys.stderr, flush=True)
        sys.exit(REFUSED)
    held.release(agent_log)  # a job that restarted after a refused round and then ran


if __name__ == "__main__":
    main()

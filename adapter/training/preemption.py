"""Leaving early with a checkpoint: ``--exit-signal-handler`` (``--exit-signal``, SIGTERM by default) and
``--exit-duration-in-mins``, as Megatron-LM has them.

A scheduler that preempts a job sends SIGTERM, to the launcher only or to every process of the job, and
kills what is left a while later. A rank must not stop where it receives the signal: the others are in the
same step's collectives, and a checkpoint is only whole when every rank writes its part of the same
iteration. So the handler only records the signal, and at the end of every iteration all ranks agree, with
one all-reduce (MAX) of two numbers, whether any rank has received it or the time budget is nearly spent
(Megatron-LM's ``DistributedSignalHandler`` all-gathers the flag for the same reason). All ranks then stop
after the same iteration, the flow saves it, and the job exits 0; the next launch with ``--load`` resumes
exactly there.

A launcher that gets the signal passes it to the workers and SIGKILLs them ``--shutdown-timeout`` seconds
later (torchrun's default ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` or 30): the iteration in flight and the save must
fit in that time, or the kill lands in the save, which loses nothing (the previous checkpoint stays,
adapter/training/checkpointing.py) but saves nothing. torchrun then exits 1 whatever the workers did;
scripts/launch.py exits 0 when they all saved.
"""

from __future__ import annotations

import signal
import time

import psutil
import torch

import adapter


class Preemption:
    """Whether the run should stop after the iteration that just ended: the same answer on every rank."""

    def __init__(self, args):
        self.signal: signal.Signals | None = args.exit_signal if args.exit_signal_handler else None
        self.budget_minutes: float | None = args.exit_duration_in_mins
        self.received = False
        # Megatron-LM counts the budget from the process's start (its imports included), as the scheduler does
        self._started = psutil.Process().create_time()
        self._iteration_started = time.time()
        self._longest_iteration = 0.0
        self._previous = None
        if self.signal is not None:
            self._previous = signal.signal(self.signal, self._receive)

    def _receive(self, signum, frame) -> None:
        """Only note it: the rank finishes its iteration, whose collectives the other ranks are in."""
        self.received = True

    def stop_reason(self) -> str | None:
        """Why every rank stops now, or None. One all-reduce of [signal received, minutes by the end of the
        next iteration] per iteration when either argument is given, nothing otherwise. The next iteration
        is estimated as the longest so far, so the run leaves before the budget runs out, not after."""
        if self.signal is None and self.budget_minutes is None:
            return None
        now = time.time()
        self._longest_iteration = max(self._longest_iteration, now - self._iteration_started)
        self._iteration_started = now
        finish_next = (now + self._longest_iteration - self._started) / 60
        # NCCL and HCCL reduce device tensors only
        state = torch.tensor([float(self.received), finish_next], device=adapter.device.torch_device())
        torch.distributed.all_reduce(state, op=torch.distributed.ReduceOp.MAX)
        received, finish_next = state.tolist()
        if received:
            return f"{self.signal.name} received"
        if self.budget_minutes is not None and finish_next >= self.budget_minutes:
            return (f"another iteration would end {finish_next:.2f} minutes after the launch, past "
                    f"--exit-duration-in-mins {self.budget_minutes:g}")
        return None

    def close(self) -> None:
        """Put back the handler that was there before (a process that trains again decides anew)."""
        if self.signal is not None:
            signal.signal(self.signal, self._previous)

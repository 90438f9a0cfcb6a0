"""megatron.training's ``--exit-signal-handler`` stop says, in one line from rank 0, after which iteration
every rank stopped and where it is saved (adapter/early_exit.py).

megatron.training already stops well on the signal (SIGTERM by default): its ``DistributedSignalHandler``
only notes it, every rank learns at the end of the same iteration (an all-gather in
``checkpoint_and_decide_exit``), saves that iteration when ``--save`` is given, and exits 0 after
``train``'s teardown (scripts/launch.py reads every worker's 0 as a job that saved). What the job shows is
"exiting program after receiving SIGTERM." with a time stamp, with neither the iteration nor whether anything
was saved. Built on that: the line, once the save has returned. Without ``--exit-signal-handler`` the signal
keeps Python's default, as in Megatron-LM: the process ends at once, and the last checkpoint published stays
the one to resume (checkpoint_publish).
"""

from __future__ import annotations

import functools
import inspect
import signal

import torch

from adapter import early_exit


def said_when_stopped(checkpoint_and_decide_exit):
    """``checkpoint_and_decide_exit``; where it stops the run on the exit signal, the line (rank 0). Which
    stop it was is asked of megatron's handler again: its all-gather, on every rank, since every rank has
    the same answer to whether the run stops."""
    signature = inspect.signature(checkpoint_and_decide_exit)

    @functools.wraps(checkpoint_and_decide_exit)
    def decide(*args, **kwargs):
        from megatron.training.global_vars import get_args, get_signal_handler

        stop = checkpoint_and_decide_exit(*args, **kwargs)
        megatron_args = get_args()
        if not (stop and megatron_args.exit_signal_handler):
            return stop
        handler = get_signal_handler()
        if any(handler.signals_received()) and torch.distributed.get_rank() == 0:
            iteration = signature.bind(*args, **kwargs).arguments["iteration"]
            reason = f"{signal.Signals(handler.sig).name} received"
            print(early_exit.stopped_line(iteration, reason, megatron_args.save), flush=True)
        return stop

    return decide


def register(registry, versions: str) -> None:
    registry.wrap("megatron.training.training:checkpoint_and_decide_exit", said_when_stopped, versions=versions,
                  reason="a stop on --exit-signal-handler's signal says the iteration and where it is saved")

"""megatron.training's ``--exit-signal-handler`` and ``--exit-duration-in-mins`` stops say, in one line from
rank 0, after which iteration every rank stopped, why, and where it is saved (adapter/early_exit.py).

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
import time

import torch

from adapter import early_exit


def said_when_stopped(checkpoint_and_decide_exit):
    """``checkpoint_and_decide_exit``; where it stops the run on the exit signal or the time budget, the line
    (rank 0)."""
    signature = inspect.signature(checkpoint_and_decide_exit)

    @functools.wraps(checkpoint_and_decide_exit)
    def decide(*args, **kwargs):
        stop = checkpoint_and_decide_exit(*args, **kwargs)
        if stop:
            from megatron.training.global_vars import get_args

            iteration = signature.bind(*args, **kwargs).arguments["iteration"]
            reason = _why_stopped(get_args(), iteration)
            if reason and torch.distributed.get_rank() == 0:
                print(early_exit.stopped_line(iteration, reason, get_args().save), flush=True)
        return stop

    return decide


def _why_stopped(megatron_args, iteration: int) -> str | None:
    """The exit signal (asked of megatron's handler again: its all-gather, on every rank, since every rank has
    the same answer to whether the run stops), else the time budget where megatron's own check stopped it
    (``--exit-interval`` reached is a planned end, said by megatron), else None."""
    from megatron.training import training
    from megatron.training.global_vars import get_signal_handler

    if megatron_args.exit_signal_handler:
        handler = get_signal_handler()
        if any(handler.signals_received()):
            return f"{signal.Signals(handler.sig).name} received"
    interval = megatron_args.exit_interval
    if megatron_args.exit_duration_in_mins and not (interval and iteration % interval == 0):
        minutes = (time.time() - training._TRAIN_START_TIME) / 60
        budget = megatron_args.exit_duration_in_mins
        return f"{minutes:.1f} minutes after the launch, past --exit-duration-in-mins {budget}"
    return None


def register(registry, versions: str) -> None:
    registry.wrap("megatron.training.training:checkpoint_and_decide_exit", said_when_stopped, versions=versions,
                  reason="a stop on the exit signal or the time budget says the iteration, why, and where it is saved")

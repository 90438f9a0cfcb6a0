"""megatron.training's run says, once, how long the process took from its start to the end of its first
iteration, and where that time went (adapter/startup_clock.py's line, which bench/startup.py parses).

megatron.training records start-up timestamps (``set_startup_timestamps``: the entry script's start and its
``__main__``, then ``pretrain``'s entry; Megatron-LM's pretrain_gpt.py and scripts/pretrain_gpt.py set the
first two) and logs their differences as timers up to the end of its initialization, but nothing up to the
first iteration, the time a user waits. Built on those: the line, from the rank that prints megatron's
training log (the last), after the first ``train_step`` of the process. A timestamp the entry script did not
set leaves its phase merged into the next.
"""

from __future__ import annotations

import functools
import sys
import time

import torch

from adapter import startup_clock

_said: list[bool] = []


def _phases(first_step: float, end: float) -> dict[str, float]:
    """Phase name -> seconds, from the process's start through megatron's timestamps to ``end``. The entry
    script's own start stands in for nothing: megatron keeps the ranks' earliest, not this process's."""
    stamps = getattr(sys.modules["megatron.training.training"], "_STARTUP_TIMESTAMPS", {})
    marks = [("imports", stamps.get("main_entry")), ("setup", stamps.get("pretrain_entry")),
             ("initialize, model and data", first_step), ("first iteration", end)]
    last, phases = startup_clock.process_start(), {}
    for name, at in marks:
        if at is not None:
            phases[name], last = at - last, at
    return phases


def said_after_first(train_step):
    """``train_step``; after this process's first, the start-up line."""

    @functools.wraps(train_step)
    def step(*args, **kwargs):
        started = time.time()
        result = train_step(*args, **kwargs)
        if not _said:
            _said.append(True)
            if torch.distributed.get_rank() == torch.distributed.get_world_size() - 1:
                print(f"[adapter] {startup_clock.line(_phases(started, time.time()))}", flush=True)
        return result

    return step


def register(registry, versions: str) -> None:
    registry.wrap("megatron.training.training:train_step", said_after_first, versions=versions,
                  reason="one line: the time from the process's start to the end of its first iteration")

"""Megatron-LM's manual garbage collection (``--manual-gc``): Python's collector off, and full collections
at the same points on every rank, between steps.

Why: the collector otherwise runs when one rank's allocation count says so, mid-step; that rank then
arrives late at the next collective and every other rank waits for it. With ``--manual-gc`` it runs every
``--manual-gc-interval`` iterations (0: never between steps) and, unless ``--no-manual-gc-eval``, before
and after each evaluation, as in Megatron-LM's ``train``. The collector's state is put back when training
ends, so a process that goes on (a test, a benchmark) collects as before.
"""

from __future__ import annotations

import contextlib
import gc


class ManualGC:
    def __init__(self, args) -> None:
        self.on, self.interval, self.around_eval = args.manual_gc, args.manual_gc_interval, args.manual_gc_eval
        self.was_enabled = gc.isenabled()
        if self.on:
            gc.disable()
            gc.collect()

    def step(self, iteration: int) -> None:
        """After ``iteration``: a full collection where the interval says so."""
        if self.on and self.interval and iteration % self.interval == 0:
            gc.collect()

    @contextlib.contextmanager
    def evaluation(self):
        """A full collection before and after an evaluation (``--manual-gc-eval``, Megatron-LM's default)."""
        if self.on and self.around_eval:
            gc.collect()
        yield
        if self.on and self.around_eval:
            gc.collect()

    def close(self) -> None:
        if self.on and self.was_enabled:
            gc.enable()

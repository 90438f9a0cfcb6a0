"""The one line a run that leaves early on its exit signal says, in either flow: which iteration every rank
finished, why it stopped, and whether (and where) that iteration is saved. A scheduler's log then shows
where the next launch resumes without reading megatron's per-rank output.

The flows stop differently (adapter/training/preemption.py for the own flow; patches/early_exit.py on
megatron.training's ``--exit-signal-handler``); the words are these.
"""

from __future__ import annotations


def stopped_line(iteration: int, reason: str, save: str | None) -> str:
    """'[adapter] stopped after iteration 7: SIGTERM received; saved in /ckpt, resume with --load'."""
    where = f"saved in {save}, resume with --load" if save else "not saved: no --save"
    return f"[adapter] stopped after iteration {iteration}: {reason}; {where}"

"""The one line a run that leaves early on its exit signal or its time budget says: which iteration every rank
finished, why it stopped, and whether (and where) that iteration is saved. A scheduler's log then shows
where the next launch resumes without reading megatron's per-rank output.

patches/early_exit.py says it on megatron.training's ``--exit-signal-handler`` and
``--exit-duration-in-mins``.
"""

from __future__ import annotations


def stopped_line(iteration: int, reason: str, save: str | None) -> str:
    """'[adapter] stopped after iteration 7: SIGTERM received; saved in /ckpt, resume with --load'."""
    where = f"saved in {save}, resume with --load" if save else "not saved: no --save"
    return f"[adapter] stopped after iteration {iteration}: {reason}; {where}"

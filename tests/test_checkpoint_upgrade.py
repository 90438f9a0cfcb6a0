"""Checkpoints across a megatron-core upgrade (issue 27): the checkpoint the project's own loop saved under
megatron-core 0.16.1 (tests/upgrade_checkpoint.py) is committed as that release saved it, and small.
tests/test_flow_resume.py resumes it in the one flow, at the layout that saved it and at another, on the curve
of the run that saved it.
"""

from __future__ import annotations

from tests.upgrade_checkpoint import DATA, ITERS, RECORDED_WITH, SAVED_AT, argv, recorded


def test_the_committed_checkpoint_is_small_and_saved_as_megatron_core_0_16_1_saves():
    run = recorded()
    assert run["megatron_core"] == RECORDED_WITH and run["argv"] == argv(2)
    assert sorted(run["lm loss"]) == list(range(1, ITERS + 1))
    assert (DATA / "latest_checkpointed_iteration.txt").read_text() == str(SAVED_AT)
    assert (DATA / f"iter_{SAVED_AT:07d}" / "common.pt").is_file()  # the common state where 0.16.1 keeps it
    assert sum(p.stat().st_size for p in DATA.rglob("*") if p.is_file()) < 3_000_000

"""Checkpoints across a megatron-core upgrade (issue 27). megatron-core 0.16.1 saved a checkpoint through the
pretrain flow (tests/upgrade_checkpoint.py). It resumes under the installed megatron-core, at the layout that
saved it and at another, and the resumed losses continue the curve of the run that saved it.

The curve is compared to 2e-4, not bit for bit: the run was recorded on one machine and torch build, and the
summation order of another may differ in the last bits. A lost optimizer state is far larger: resumed with
--no-load-optim (fresh Adam moments and LR schedule), the curve is off by 0.09 at iteration 6 (measured with
megatron-core 0.19.2). Iteration 5 runs before the first step after the resume; it checks the weights and the
data order.
"""

from __future__ import annotations

import pytest

from tests.distributed import run_ranks
from tests.pretrain_ranks import logged_losses, run_pretrain_printing, stopped_at
from tests.upgrade_checkpoint import DATA, ITERS, RECORDED_WITH, SAVED_AT, argv, recorded

TOLERANCE = 2e-4


def test_the_committed_checkpoint_is_small_and_saved_as_megatron_core_0_16_1_saves():
    run = recorded()
    assert run["megatron_core"] == RECORDED_WITH and run["argv"] == argv(2)
    assert sorted(run["lm loss"]) == list(range(1, ITERS + 1))
    assert (DATA / "latest_checkpointed_iteration.txt").read_text() == str(SAVED_AT)
    assert (DATA / f"iter_{SAVED_AT:07d}" / "common.pt").is_file()  # the common state where 0.16.1 keeps it
    assert sum(p.stat().st_size for p in DATA.rglob("*") if p.is_file()) < 3_000_000


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("tp, ranks", [(2, 2), (1, 2)], ids=["same layout TP2", "TP1 x DP2"])
def test_a_checkpoint_saved_by_megatron_core_0_16_1_resumes_on_the_curve(tmp_path, tp, ranks):
    """Resumed from iteration 4 under the installed megatron-core: at TP2, the layout that saved it, and at
    TP1 x DP2, where the distributed optimizer's state is resharded. Iterations 5-8 give the recorded losses."""
    load = stopped_at(DATA, SAVED_AT, tmp_path)
    results = run_ranks(ranks, run_pretrain_printing, argv(tp, "--load", str(load)))
    assert f"loaded {load / f'iter_{SAVED_AT:07d}'} (iteration {SAVED_AT}" in results[0]["stdout"]
    curve, resumed = recorded()["lm loss"], logged_losses(results)
    assert sorted(resumed) == list(range(SAVED_AT + 1, ITERS + 1))
    worst = max(abs(resumed[i] - curve[i]) for i in resumed)
    assert worst <= TOLERANCE, f"largest loss difference {worst:.3g}: {resumed} vs recorded {curve}"

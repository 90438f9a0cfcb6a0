"""megatron.training's own ``save_checkpoint`` (Megatron-LM's pretrain_gpt.py through ``adapter.run`` saves
with it) publishes as the flow does (``adapter/checkpoint_publish.py``): a save killed midway leaves the
previous checkpoint and tracker readable and the next start recovers; a save failing on one rank stops every
rank with that error. On 2 gloo ranks through the wheel's megatron.training, no Megatron-LM checkout; the
end-to-end run of Megatron-LM's script is in tests/test_megatron_lm.py."""

from __future__ import annotations

import pytest

from adapter.checkpoint_dir import TRACKER, is_complete
from tests.distributed import launch_ranks, run_ranks, RankFailure
from tests.megatron_save_ranks import loaded_after_the_kill, saved_then_failing, saved_then_killed_resaving
from tests.test_checkpoint_interchange import TINY

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]
pytest.importorskip("megatron.training.checkpointing", reason="megatron-core's wheel ships megatron.training from 0.17")

ARGV = [*TINY, "--distributed-timeout-minutes", "1"]


@pytest.mark.parametrize("step", ["partial written", "old copy moved aside"])
def test_a_resave_killed_midway_leaves_the_checkpoint_loadable_and_the_next_start_recovers(tmp_path, step):
    """Iteration 1 saved (asynchronously) and saved again, every rank killed at ``step`` of the second save:
    the tracker still names a complete iteration 1 (at once, or once the old copy is put back), megatron's
    load on a fresh start gives back the parameters saved, and nothing half done is left."""
    save, pids = tmp_path / "checkpoints", tmp_path / "pids"
    pids.mkdir()
    with pytest.raises(RankFailure):
        run_ranks(2, saved_then_killed_resaving, ARGV, str(save), step, str(pids))
    assert (save / TRACKER).read_text() == "1"
    assert is_complete(save / "iter_0000001") == (step == "partial written")
    assert [r for r in run_ranks(2, loaded_after_the_kill, ARGV, str(save))] == [{"iteration": 1, "same": True}] * 2
    assert sorted(p.name for p in save.iterdir()) == ["iter_0000001", TRACKER]


def test_a_save_failing_on_one_rank_stops_every_rank_with_that_error(tmp_path):
    """Iteration 1 saved; rank 1's disk is full as it writes iteration 2, while rank 0 is in megatron's
    collectives. Every rank exits non-zero saying the error, within seconds of each other (not at megatron's
    1-minute timeout); iteration 1 stays published. (A failed publish on rank 0 takes the same way out.)"""
    ranks = launch_ranks(2, saved_then_failing, ARGV, str(tmp_path), "rank 1 cannot write", timeout=300)
    logs = "\n".join(r["log"][-2000:] for r in ranks)
    assert all(r["status"] not in (0, None) for r in ranks), logs
    assert all(f"saving iteration 2 to {tmp_path} failed on rank 1" in r["log"]
               and "No space left on device" in r["log"]
               for r in ranks), logs
    seconds = [r["seconds"] for r in ranks]
    assert max(seconds) - min(seconds) < 30, seconds
    assert (tmp_path / TRACKER).read_text() == "1" and is_complete(tmp_path / "iter_0000001")
    assert not (tmp_path / "iter_0000002").exists()

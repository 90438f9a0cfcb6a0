"""Publishing a checkpoint and finding the one to load, on directories laid out as each instant of a save
leaves them (adapter.checkpoint_dir): quick, in process; tests/test_checkpoint_safety.py kills real ranks."""

from __future__ import annotations

import pytest
from packaging.version import Version

from adapter import checkpoint_dir
from adapter.checkpoint_dir import TRACKER, CheckpointError


def _checkpoint(path, content: str = "old", common: bool = True):
    """A stand-in for a complete torch_dist checkpoint: the two files a finished save writes last, and the
    common.pt of megatron-core before 0.19 (``common``; every release reads it)."""
    path.mkdir(parents=True)
    (path / checkpoint_dir.METADATA_FILE).write_text(content)
    (path / ".metadata").write_text(content)
    if common:
        (path / checkpoint_dir.COMMON_FILE).write_text(content)
    return path


def _published(tmp_path, iteration: int = 5):
    _checkpoint(tmp_path / checkpoint_dir.checkpoint_name(iteration))
    (tmp_path / TRACKER).write_text(str(iteration))
    return tmp_path / checkpoint_dir.checkpoint_name(iteration)


def test_publishing_over_an_existing_iteration_leaves_the_new_copy_and_nothing_else(tmp_path):
    final = _published(tmp_path)
    partial = _checkpoint(tmp_path / ".iter_0000005.partial", "new")
    assert checkpoint_dir.publish(partial, 5) == final
    assert (final / "metadata.json").read_text() == "new"
    assert (tmp_path / TRACKER).read_text() == "5"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000005", TRACKER]


def test_each_step_of_a_publish_is_on_disk_before_the_next(tmp_path, monkeypatch):
    _published(tmp_path)
    partial = _checkpoint(tmp_path / ".iter_0000005.partial", "new")
    steps = []
    monkeypatch.setattr(checkpoint_dir, "_fsync", lambda path: steps.append(("fsync", path.name)))
    for name in ("rename", "replace"):
        original = getattr(checkpoint_dir.os, name)
        monkeypatch.setattr(checkpoint_dir.os, name, lambda src, dst, original=original, name=name: (
            steps.append((name, f"{src.name} -> {dst.name}")), original(src, dst))[1])
    checkpoint_dir.publish(partial, 5)
    moves = [i for i, step in enumerate(steps) if step[0] != "fsync"]
    assert [steps[i] for i in moves] == [("rename", "iter_0000005 -> .iter_0000005.replaced"),
                                         ("rename", ".iter_0000005.partial -> iter_0000005"),
                                         ("replace", f".{TRACKER}.partial -> {TRACKER}")]
    # the written files and their directory before the first move; the directory after each move
    assert {"metadata.json", ".metadata", ".iter_0000005.partial"} <= {name for _, name in steps[:moves[0]]}
    assert all(steps[i + 1] == ("fsync", tmp_path.name) for i in moves)


@pytest.mark.parametrize("state, loads", [
    ("partial written", "old"), ("old copy moved aside", "old"), ("new copy moved in", "new"),
    ("tracker replaced", "new")])
def test_the_next_start_loads_a_complete_copy_after_a_kill_at_each_step(tmp_path, state, loads):
    """The directory as a kill at ``state`` leaves it, for a re-save of the iteration the tracker names."""
    final = _published(tmp_path)
    _checkpoint(tmp_path / ".iter_0000005.partial", "new")
    if state != "partial written":
        final.rename(tmp_path / ".iter_0000005.replaced")
    if state in ("new copy moved in", "tracker replaced"):
        (tmp_path / ".iter_0000005.partial").rename(final)
    assert checkpoint_dir.checkpoint_to_load(tmp_path, recoverable=True) == final
    done = checkpoint_dir.recover_interrupted_save(tmp_path)
    assert done and all(".iter_0000005." in line for line in done)
    assert checkpoint_dir.checkpoint_to_load(tmp_path) == final
    assert (final / "metadata.json").read_text() == loads
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000005", TRACKER]


def test_a_copy_moved_aside_is_named_where_it_cannot_be_put_back(tmp_path):
    final = _published(tmp_path)
    final.rename(tmp_path / ".iter_0000005.replaced")
    with pytest.raises(CheckpointError, match=r"names .*iter_0000005, which is missing; its previous copy is "
                                              r"complete at \.iter_0000005\.replaced .*rename it to iter_0000005"):
        checkpoint_dir.checkpoint_to_load(tmp_path)


@pytest.mark.parametrize("tracker, message", [
    ("9", r"names .*iter_0000009, which is missing; the newest complete checkpoint there is iter_0000005: "
          r"write 5 into latest_checkpointed_iteration.txt"),
    ("7", r"names .*iter_0000007, which is incomplete .*the newest complete checkpoint there is iter_0000005"),
    ("seven", r"holds 'seven', not an iteration number"),
    (None, r"holds iter_0000005 but no latest_checkpointed_iteration.txt: write 5 into"),
])
def test_a_tracker_that_does_not_lead_to_a_complete_checkpoint_is_an_error(tmp_path, tracker, message):
    _published(tmp_path)
    (tmp_path / "iter_0000007").mkdir()  # a save that never finished
    if tracker is None:
        (tmp_path / TRACKER).unlink()
    else:
        (tmp_path / TRACKER).write_text(tracker)
    with pytest.raises(CheckpointError, match=message):
        checkpoint_dir.checkpoint_to_load(tmp_path)


def test_nothing_published_is_a_start_from_scratch(tmp_path):
    (tmp_path / ".iter_0000003.partial").mkdir()
    assert checkpoint_dir.checkpoint_to_load(tmp_path) is None
    assert checkpoint_dir.checkpoint_to_load(tmp_path / "not-there") is None


def test_an_fsdp_dtensor_checkpoint_has_no_common_pt_and_is_read_on_every_release(tmp_path):
    """fsdp_dtensor (torch's files, no megatron metadata.json) never has a common.pt, whichever release saved it:
    0.17 and 0.18 read it (they refused the flow's own save, whose refusal named 0.19, before the fix)."""
    checkpoint = tmp_path / "iter_0000005"
    checkpoint.mkdir()
    (checkpoint / ".metadata").write_text("torch's")
    (tmp_path / TRACKER).write_text("5")
    assert checkpoint_dir.checkpoint_to_load(tmp_path) == checkpoint
    assert checkpoint_dir.iteration_dir(tmp_path, 5) == checkpoint


@pytest.mark.parametrize("where", ["tracker", "directory", "iteration"])
def test_a_checkpoint_without_common_pt_is_refused_where_megatron_cannot_read_it(tmp_path, where):
    """A checkpoint saved by megatron-core 0.19 or later keeps its common state inside the torch_dist files,
    without common.pt: 0.19 and later read it, 0.16-0.18 are refused in one line naming it (megatron's own
    loader would stop with "Common file ... does not exist" once every rank had built its model)."""
    checkpoint = _checkpoint(tmp_path / "iter_0000005", common=False)
    (tmp_path / TRACKER).write_text("5")
    find = {"tracker": lambda: checkpoint_dir.checkpoint_to_load(tmp_path),
            "directory": lambda: checkpoint_dir.checkpoint_to_load(checkpoint),
            "iteration": lambda: checkpoint_dir.iteration_dir(tmp_path, 5)}[where]
    if checkpoint_dir.MEGATRON_CORE >= Version("0.19"):
        assert find() == checkpoint
        return
    with pytest.raises(CheckpointError) as refused:
        find()
    assert str(refused.value) == (
        f"{checkpoint} was saved by megatron-core 0.19 or later (its common state is inside the torch_dist files; "
        f"there is no common.pt), which megatron-core {checkpoint_dir.MEGATRON_CORE} cannot read: load it with "
        "megatron-core 0.19 or later")

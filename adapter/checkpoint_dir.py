"""The checkpoint directory protocol, as Megatron-LM lays a checkpoint directory out on disk, in one place
for the training flow and conversion:

    <dir>/latest_checkpointed_iteration.txt   "release" or the iteration number (the tracker)
    <dir>/release/ or <dir>/iter_0000100/     metadata.json, .metadata, *.distcp (and common.pt, before 0.19);
                                              fsdp_dtensor: .metadata, *.distcp

What to load (the tracker's checkpoint, refused with the fix when it is missing, incomplete or unreadable by
the installed release), how a written checkpoint is published (never lost, whenever the process is killed),
and how a killed save is recovered. What is inside the files is ``torch_dist_io``'s.

The plain (non-tensor) "common" state moved in megatron-core 0.19: up to 0.18 ``dist_checkpointing.save``
writes it to ``common.pt``; from 0.19 it is the ShardedObject ``common_state`` inside the torch_dist files
and no ``common.pt`` is written. 0.19 still reads a ``common.pt`` (so checkpoints saved before the upgrade
resume), 0.16-0.18 cannot read the new form: such a checkpoint is refused up front (``readable_here``).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from packaging.version import Version

from adapter.registry import installed_megatron_core_version

TRACKER = "latest_checkpointed_iteration.txt"
RELEASE = "release"
CHECKPOINT_VERSION = 3.0  # Megatron-LM's current checkpoint_version
COMMON_FILE = "common.pt"  # the common state up to megatron-core 0.18
METADATA_FILE = "metadata.json"  # megatron's, naming the format: torch_dist writes it, fsdp_dtensor does not
MEGATRON_CORE = Version(installed_megatron_core_version())
# From 0.19 the common state is this ShardedObject inside the torch_dist files (its unique key "common_state/shard_0_1")
COMMON_STATE_IN_SHARDS = MEGATRON_CORE >= Version("0.19")


class CheckpointError(ValueError):
    """A checkpoint directory that is missing, incomplete or not what the caller expects."""


PARTIAL = ".partial"  # a checkpoint being written, beside its final name
REPLACED = ".replaced"  # the previous copy of an iteration saved again, until the new one is published


def aside(path: Path, suffix: str) -> Path:
    """``.<name><suffix>`` beside ``path``: hidden, so nothing that lists iterations takes it for one."""
    return path.with_name(f".{path.name}{suffix}")


def checkpoint_name(iteration: int | str) -> str:
    return RELEASE if str(iteration) == RELEASE else f"iter_{int(iteration):07d}"


def is_complete(path: Path) -> bool:
    """A checkpoint whose save finished: torch writes ``.metadata`` once every rank's chunks are written. For
    torch_dist megatron writes ``metadata.json`` after it, which names the format; an fsdp_dtensor checkpoint
    has none (Megatron-LM writes none, and takes a directory with one for torch_dist). A torch_dist save killed
    between the two (Megatron-LM writes in place) so reads as fsdp_dtensor, which a torch_dist run refuses."""
    return (path / ".metadata").is_file()


def newest_complete(load_dir: Path) -> Path | None:
    done = [p for p in load_dir.glob("iter_*") if p.name[5:].isdigit() and is_complete(p)]
    return max(done, key=lambda p: int(p.name[5:]), default=None)


def checkpoint_to_load(load_dir: str | os.PathLike, recoverable: bool = False) -> Path | None:
    """The checkpoint ``load_dir``'s tracker names (``load_dir`` itself if it is one); None when nothing was
    ever published there (no tracker, no complete iteration: training starts from scratch).

    A tracker naming a missing or incomplete checkpoint, or complete iterations without a tracker, is a
    CheckpointError naming it and the newest complete one: never a silent start from scratch, which would
    then overwrite the iterations there. ``recoverable``: ``load_dir`` is the run's own --save directory,
    where ``recover_interrupted_save`` first puts back the previous copy a killed re-save moved aside."""
    load_dir = Path(load_dir)
    if is_complete(load_dir):
        readable_here(load_dir)
        return load_dir
    tracker = load_dir / TRACKER
    newest = newest_complete(load_dir) if load_dir.is_dir() else None
    if not tracker.is_file():
        if newest is None:
            return None
        raise CheckpointError(f"{load_dir} holds {newest.name} but no {TRACKER}: write {int(newest.name[5:])} into "
                              f"{tracker} to resume from it, or load from an empty directory to start afresh")
    text = tracker.read_text().strip()
    if text != RELEASE and not text.isdigit():
        raise CheckpointError(f"{tracker} holds {text!r}, not an iteration number or {RELEASE!r}")
    path = load_dir / checkpoint_name(text)
    if is_complete(path) or (recoverable and is_complete(aside(path, REPLACED))):
        readable_here(path if is_complete(path) else aside(path, REPLACED))
        return path
    state = "incomplete (no .metadata)" if path.exists() else "missing"
    previous = aside(path, REPLACED)
    fix = (f"; its previous copy is complete at {previous.name} (a save was killed while replacing it): "
           f"rename it to {path.name}" if is_complete(previous) else
           f"; the newest complete checkpoint there is {newest.name}: write {int(newest.name[5:])} into "
           f"{TRACKER} to resume from it" if newest else "; there is no complete checkpoint there")
    raise CheckpointError(f"{TRACKER} names {path}, which is {state}{fix}")


def iteration_dir(load_dir: str | os.PathLike, iteration: int | str | None = None) -> Path:
    """The checkpoint directory in ``load_dir``: ``iteration`` if given, else what the tracker file names;
    ``load_dir`` itself when it is a checkpoint directory (has .metadata)."""
    load_dir = Path(load_dir)
    if iteration is None:
        path = checkpoint_to_load(load_dir)
        if path is None:
            raise CheckpointError(f"{load_dir} holds no megatron checkpoint: neither {TRACKER} nor "
                                  "a checkpoint's .metadata is there (pass the directory given to --save)")
        return path
    path = load_dir / checkpoint_name(iteration)
    if not is_complete(path):
        raise CheckpointError(f"{path} is not a complete checkpoint (no .metadata)")
    readable_here(path)
    return path


def readable_here(checkpoint: Path) -> None:
    """Refuse a complete checkpoint the installed megatron-core cannot read, before any rank loads it.

    Every release reads a torch_dist checkpoint with ``common.pt`` (0.19 as its legacy form). One without it was
    saved by 0.19 or later, whose common state only 0.19 and later find: 0.16-0.18 would stop inside megatron's
    loader ("Common file ... does not exist") after every rank had built its model. An fsdp_dtensor checkpoint
    (no ``metadata.json``) has no ``common.pt`` on any release: nothing to refuse."""
    if COMMON_STATE_IN_SHARDS or not (checkpoint / METADATA_FILE).is_file() or (checkpoint / COMMON_FILE).is_file():
        return
    raise CheckpointError(f"{checkpoint} was saved by megatron-core 0.19 or later (its common state is inside the "
                          f"torch_dist files; there is no {COMMON_FILE}), which megatron-core {MEGATRON_CORE} "
                          "cannot read: load it with megatron-core 0.19 or later")


# ---------------------------------------------------------------------------------------------------------
# publishing: a checkpoint is never lost, whenever the process is killed

def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_tree(path: Path) -> None:
    """Put a written checkpoint on disk: every file but the ``.distcp`` chunks (their writers fsync those,
    on whichever node wrote them), then each directory's entries."""
    for folder, _, files in os.walk(path):
        for name in files:
            if not name.endswith(".distcp"):
                _fsync(Path(folder) / name)
        _fsync(Path(folder))


def write_tracker(save_dir: Path, iteration: int | str) -> None:
    """Point the tracker at ``iteration``: written beside it, on disk, then renamed over it."""
    tracker = aside(save_dir / TRACKER, PARTIAL)
    with open(tracker, "w") as out:
        out.write(str(iteration))
        out.flush()
        os.fsync(out.fileno())
    os.replace(tracker, save_dir / TRACKER)
    _fsync(save_dir)


def publish(partial: Path, iteration: int | str) -> Path:
    """Make the complete checkpoint written at ``partial`` the one its iteration's name and the tracker
    point to. Each step is on disk before the next, so a process killed at any instant leaves a complete
    checkpoint where the tracker points, or one ``recover_interrupted_save`` puts back: an existing copy
    of the iteration moves aside before the new one moves in, the tracker is replaced after, and the old
    copy is removed last."""
    save_dir = partial.parent
    final, previous = save_dir / checkpoint_name(iteration), aside(save_dir / checkpoint_name(iteration), REPLACED)
    sync_tree(partial)
    if final.exists():
        shutil.rmtree(previous, ignore_errors=True)  # left by an earlier kill, with ``final`` complete
        os.rename(final, previous)
        _fsync(save_dir)
    os.rename(partial, final)
    _fsync(save_dir)
    write_tracker(save_dir, iteration)
    if previous.exists():
        shutil.rmtree(previous)
    return final


def recover_interrupted_save(save_dir: str | os.PathLike) -> list[str]:
    """Finish or undo what a save killed while publishing left in ``save_dir``; returns what it did.

    A previous copy moved aside goes back if the new one never moved in, and is removed if it did (the
    new one is complete: it is renamed in only then); unpublished partial writes are removed. Only for a
    run's own --save directory, before it saves: another job may be publishing in a directory it loads."""
    save_dir, done = Path(save_dir), []
    for previous in sorted(save_dir.glob(f".*{REPLACED}")):
        final = save_dir / previous.name[1:-len(REPLACED)]
        if final.exists():
            shutil.rmtree(previous)
            done.append(f"removed {previous.name}, the replaced copy of the complete {final.name}")
        else:
            os.rename(previous, final)
            done.append(f"restored {final.name} from {previous.name} (a save was killed while replacing it)")
    for partial in sorted(save_dir.glob(f".*{PARTIAL}")):
        shutil.rmtree(partial) if partial.is_dir() else partial.unlink()
        done.append(f"removed {partial.name}, an unpublished write")
    if done:
        _fsync(save_dir)
    return done


def read_common(checkpoint: Path) -> dict:
    """The plain state of ``checkpoint``, through megatron's own reader: it finds ``common.pt`` on every
    release, and from 0.19 also the ``common_state`` object that replaced it."""
    from megatron.core import dist_checkpointing

    readable_here(checkpoint)
    return dist_checkpointing.load_common_state_dict(str(checkpoint))

"""megatron.training's checkpoint saves, published so that none is ever lost.

Megatron-LM's ``save_checkpoint`` writes ``iter_N`` in place and then rewrites the tracker with a plain
``open(..., 'w')``: a process killed while it saves an iteration again (a finished job started again, a
rolled-back tracker) leaves the tracker on a half-written directory, and one killed in the tracker write
leaves an empty tracker; megatron's next start then refuses both. And a save that fails on one rank leaves
the others in megatron's barrier until the distributed timeout, with an error that says nothing of why.

Here (``patches/checkpoint_publish.py`` installs it) a persistent save is written into
``.iter_N.partial`` (``checkpoint_name``, while the save runs), and megatron's tracker write is where rank 0
publishes it (``tracker_open``: ``adapter.checkpoint_dir.publish`` moves the old copy aside, the new one in,
replaces the tracker, removes the old copy, each step on disk before the next); megatron's own write goes
nowhere. That is the moment megatron chose for the tracker: after every rank's write and megatron's
finalization (in the finalize step of ``--async-save``), before it deletes a checkpoint ``--save-retain-
interval`` lets go. The first save or load of a process puts back what a killed save left
(``recover_interrupted_save``). A save, and the finalization of an asynchronous one, fails on every rank
with the failing rank's error (``adapter.shared_outcome``).

Not covered: non-persistent checkpoints (``--non-persistent-save-interval``: megatron deletes and rewrites
them by design) and object storage (``--enable-msc``), which megatron saves as it does.
"""

from __future__ import annotations

import datetime
import functools
import inspect
import os
from pathlib import Path

import torch

from adapter import checkpoint_dir
from adapter.shared_outcome import shared_outcome

_saving: tuple[str, str] | None = None  # (iter_N's path, its .partial's) while this process's save runs
_pending: dict[str, list[tuple[Path, int | str]]] = {}  # tracker path -> saves to publish there, in order
_recovered: set[str] = set()  # the --save directories this process has recovered


def _args():
    from megatron.training.global_vars import get_args

    return get_args()


def _timeout(args) -> datetime.timedelta:
    return datetime.timedelta(minutes=args.distributed_timeout_minutes)


def _published(args, non_persistent: bool) -> bool:
    """Whether this save goes through the publish: a persistent save to a local --save directory."""
    return bool(args.save) and not non_persistent and not getattr(args, "enable_msc", False)


def recover_interrupted_save(args) -> None:
    """Once per process and --save directory, before anything is loaded from or saved there: rank 0 finishes
    or undoes what a killed save left (``checkpoint_dir.recover_interrupted_save``), every rank waiting."""
    save = os.path.abspath(args.save)
    if save in _recovered:
        return
    _recovered.add(save)
    with shared_outcome(f"recovering {args.save}", _timeout(args)):
        if torch.distributed.get_rank() == 0 and Path(save).is_dir():
            for line in checkpoint_dir.recover_interrupted_save(save):
                print(f"{args.save}: {line}", flush=True)


def published_save(save_checkpoint):
    """megatron.training's ``save_checkpoint``, writing into ``.iter_N.partial`` and published at its
    tracker write; a failure on any rank stops every rank with that rank's error."""
    signature = inspect.signature(save_checkpoint)

    @functools.wraps(save_checkpoint)
    def save(*call, **kwargs):
        global _saving
        args, given = _args(), signature.bind(*call, **kwargs).arguments
        if not _published(args, given.get("non_persistent_ckpt", False)):
            return save_checkpoint(*call, **kwargs)
        recover_interrupted_save(args)
        name = checkpoint_dir.RELEASE if given.get("release", False) else given["iteration"]
        final = Path(os.path.abspath(args.save)) / checkpoint_dir.checkpoint_name(name)
        partial = checkpoint_dir.aside(final, checkpoint_dir.PARTIAL)
        with shared_outcome(f"saving iteration {given['iteration']} to {args.save}", _timeout(args)):
            if torch.distributed.get_rank() == 0:
                _pending.setdefault(str(final.parent / checkpoint_dir.TRACKER), []).append((partial, name))
            _saving = (str(final), str(partial))
            try:
                return save_checkpoint(*call, **kwargs)
            finally:
                _saving = None

    return save


def partial_checkpoint_name(get_checkpoint_name):
    """``get_checkpoint_name``: while a published save runs, its iteration's names lie in its ``.partial``."""

    @functools.wraps(get_checkpoint_name)
    def name(checkpoints_path, iteration, release=False, *rest, **kwargs):
        path = get_checkpoint_name(checkpoints_path, iteration, release, *rest, **kwargs)
        if _saving is None:
            return path
        base = get_checkpoint_name(checkpoints_path, iteration, release, return_base_dir=True)
        if os.path.abspath(base) != _saving[0]:
            return path
        return _saving[1] + os.path.abspath(path)[len(_saving[0]):]

    return name


def tracker_open(open_file):
    """megatron.training.checkpointing's opener (``open_file`` up to 0.18, ``maybe_msc.open`` from 0.19):
    a write of a tracker that a published save is waiting for publishes that save instead (the tracker is
    then replaced, atomically, by ``checkpoint_dir.publish``), and megatron's own write goes to the null
    device; everything else opens as before."""

    @functools.wraps(open_file)
    def opened(filename, mode="r", *rest, **kwargs):
        waiting = _pending.get(os.path.abspath(os.fspath(filename))) if "w" in mode else None
        if not waiting:
            return open_file(filename, mode, *rest, **kwargs)
        checkpoint_dir.publish(*waiting.pop(0))
        return open(os.devnull, mode)

    return opened


class TrackerPublishingStorage:
    """megatron 0.19's ``maybe_msc`` in megatron.training.checkpointing: megatron.core's, with ``open``
    going through ``tracker_open``."""

    def __getattr__(self, name):
        from megatron.core.msc_utils import maybe_msc

        return getattr(maybe_msc, name)

    def open(self, filename, mode="r", *rest, **kwargs):
        from megatron.core.msc_utils import maybe_msc

        return tracker_open(maybe_msc.open)(filename, mode, *rest, **kwargs)


def tracker_open_file(filename, mode="r", *rest, **kwargs):
    """megatron.core's ``open_file`` (up to 0.18) through ``tracker_open``."""
    from megatron.core.msc_utils import open_file

    return tracker_open(open_file)(filename, mode, *rest, **kwargs)


def recovered_before_load(load_checkpoint):
    """``load_checkpoint`` after the --save directory is recovered: a resumed run loads what the tracker
    names, which a save killed while replacing it may have left aside."""

    @functools.wraps(load_checkpoint)
    def load(*call, **kwargs):
        args = _args()
        if _published(args, False):
            recover_interrupted_save(args)
        return load_checkpoint(*call, **kwargs)

    return load


def shared_async_finalize(maybe_finalize_async_save):
    """``maybe_finalize_async_save``, which publishes finished asynchronous saves (their tracker write is a
    finalize step): while any is pending, a failure on any rank stops every rank with that rank's error."""

    @functools.wraps(maybe_finalize_async_save)
    def finalize(*call, **kwargs):
        from megatron.training.async_utils import is_empty_async_queue

        args = _args()
        if not args.async_save or is_empty_async_queue():
            return maybe_finalize_async_save(*call, **kwargs)
        with shared_outcome(f"finishing an asynchronous save to {args.save}", _timeout(args)):
            return maybe_finalize_async_save(*call, **kwargs)

    return finalize

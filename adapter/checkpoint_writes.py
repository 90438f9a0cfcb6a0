"""A synchronous save's write results, collected in the saving process instead of through a spawned
multiprocessing Manager (installed by ``patches/checkpoint_writes.py``).

megatron's checkpoint writer (``FileSystemWriterAsync``, behind every ``torch_dist`` save, synchronous or
not) hands its write results through the queue ``get_write_results_queue`` gives it (0.16:
``_get_write_results_queue``): on the first save, a queue of a Manager started with 'spawn'. That is a
fresh interpreter which re-imports the entry script, and torch and megatron with it: about 8 s of CPU per
rank before the first checkpoint is written, the same on a GPU node. An asynchronous save needs it (the
writing process is another one). A synchronous save writes and collects in the saving process, where a
plain queue serves. Inside ``results_in_process()``, which megatron.training's ``save_checkpoint`` enters
without ``--async-save`` (``in_process_unless_async``), the writer gets one; every other save, the
asynchronous ones, gets megatron's own queue.
"""

from __future__ import annotations

import contextlib
import functools
import queue
import threading

_SCOPE = threading.local()


@contextlib.contextmanager
def results_in_process():
    """Checkpoint saves in this block, on this thread, are synchronous: their write results go through an
    in-process queue."""
    outer = getattr(_SCOPE, "queue", None)
    _SCOPE.queue = queue.Queue()
    try:
        yield
    finally:
        _SCOPE.queue = outer


def in_process_when_synchronous(get_results_queue):
    """Registry wrapper for megatron's ``get_write_results_queue``: the in-process queue of the enclosing
    ``results_in_process()``, else megatron's."""

    @functools.wraps(get_results_queue)
    def write_results_queue(*args, **kwargs):
        own = getattr(_SCOPE, "queue", None)
        return own if own is not None else get_results_queue(*args, **kwargs)

    return write_results_queue


def in_process_unless_async(save_checkpoint):
    """Registry wrapper for megatron.training's ``save_checkpoint``: without ``--async-save`` its writes and
    their results stay in the saving process (``results_in_process``), so its first save spawns no Manager."""

    @functools.wraps(save_checkpoint)
    def save(*call, **kwargs):
        from megatron.training.global_vars import get_args  # the target's own package, loaded by now

        if get_args().async_save:
            return save_checkpoint(*call, **kwargs)
        with results_in_process():
            return save_checkpoint(*call, **kwargs)

    return save

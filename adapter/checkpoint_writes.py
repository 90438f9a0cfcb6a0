"""A synchronous save's write results, collected in the saving process instead of through a spawned
multiprocessing Manager; an asynchronous save's host tensors copied before training goes on; and megatron's
persistent checkpoint worker started with the adapter first (installed by ``patches/checkpoint_writes.py``).

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


def host_tensors_copied_unless_synchronous(preload_tensors):
    """Registry wrapper for ``FileSystemWriterAsync.preload_tensors``, which stages an asynchronous save's
    tensors with ``tensor.to("cpu")`` before training goes on, trusting that to copy them (the "D2H"). A
    tensor already on the host (every tensor on the cpu backend; offloaded optimizer state elsewhere) comes
    back as itself, its storage moved to shared memory when handed to the persistent worker, so the writer
    read parameters the next steps were updating: an iteration-2 checkpoint with iteration-3 values, now and
    then. Outside ``results_in_process()`` (an asynchronous save) host tensors are copied first; a
    synchronous save writes before training goes on and copies nothing."""

    @functools.wraps(preload_tensors)
    def preload(write_buckets, *args, **kwargs):
        if getattr(_SCOPE, "queue", None) is None:
            write_buckets = [(name, key, (bytes_data, [(item, t.clone() if t.device.type == "cpu" else t)
                                                       for item, t in tensors]))
                             for name, key, (bytes_data, tensors) in write_buckets]
        return preload_tensors(write_buckets, *args, **kwargs)

    return preload


class _LoopAfterTheAdapter:
    """megatron's persistent checkpoint worker loop (``PersistentAsyncCaller.async_loop``) as its process's
    target. megatron starts that process with 'spawn' or 'forkserver': a fresh interpreter that unpickles the
    target. The adapter is imported there only where the parent's main module imports it (scripts/pretrain_gpt.py
    does; a notebook, a test harness or a script that imports it later do not), and without it the loop's
    ``torch.cuda.set_device(rank % torch.cuda.device_count())`` raised ZeroDivisionError off CUDA while the
    trainer waited on the worker for good. Unpickled, this is ``_worker_loop()``: importing this module imports
    the adapter first, and the loop is that process's own, routed."""

    def __init__(self, loop):
        self._loop = loop
        functools.update_wrapper(self, loop)

    def __call__(self, *args, **kwargs):
        return self._loop(*args, **kwargs)

    def __reduce__(self):
        return _worker_loop, ()


def _worker_loop():
    from megatron.core.dist_checkpointing.strategies.async_utils import PersistentAsyncCaller

    return PersistentAsyncCaller.async_loop


def loop_after_the_adapter(async_loop):
    """Registry wrapper for ``PersistentAsyncCaller.async_loop``: see ``_LoopAfterTheAdapter``."""
    return _LoopAfterTheAdapter(async_loop)

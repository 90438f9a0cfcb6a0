"""One outcome for a step every rank takes: if it fails on any rank, every rank stops with that error.

A save is such a step. When one rank fails (disk full, permission denied, a rename on rank 0), the others
may be blocked in a collective the failed rank will never reach: megatron's own barrier, the next
all-gather. Waiting for the collective timeout would leave each of them with a timeout error that says
nothing of the cause, or, with no timeout, waiting forever. So the failure travels out of band, through
the store the process group was set up with (rank 0's TCPStore, or torchrun's agent's): the failed rank
records its error there, and a watcher thread on every other rank, blocked on that key, prints the error
and ends its process, however its main thread is blocked. The failed rank waits (up to the timeout) for
every rank to have read the error, since the store may live in its own process, then raises it.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import os
import sys
import threading
import time

import torch

from adapter.liveness import end_children

_STEPS = itertools.count()  # every rank enters the same steps in the same order: same keys everywhere
_POLL = 0.5  # seconds between a watcher's looks at the store (one cheap request each)


class StepFailed(RuntimeError):
    """A step failed on some rank; every rank stops with that rank's error."""


def _store(step: int):
    from torch.distributed import PrefixStore
    from torch.distributed.distributed_c10d import _get_default_store

    return PrefixStore(f"adapter/step{step}/", _get_default_store())


def _failure(store) -> str:
    rank = store.get("failed").decode()
    return store.get(f"error{rank}").decode()


@contextlib.contextmanager
def shared_outcome(what: str, timeout: datetime.timedelta):
    """Run the block on every rank. If it raises on one, every rank stops with ``what``, the rank and its
    error within ``timeout``: the failed rank raises ``StepFailed``, the others print it and exit with
    status 1. On success every rank leaves the block together (a barrier)."""
    store, rank = _store(next(_STEPS)), torch.distributed.get_rank()
    ended = threading.Event()
    watcher = threading.Thread(target=_watch, args=(store, ended), daemon=True)
    watcher.start()
    try:
        yield
        torch.distributed.barrier()
    except BaseException as exc:
        ended.set()
        watcher.join()
        store.set(f"error{rank}", f"{what} failed on rank {rank}: {type(exc).__name__}: {exc}")
        store.compare_set("failed", "", str(rank))  # the first failure is the one every rank reports
        failure = _failure(store)
        _count_read(store)
        _wait_until_all_read(store, timeout)
        raise StepFailed(failure) from exc
    finally:
        ended.set()
        watcher.join()


def _wait_until_all_read(store, timeout: datetime.timedelta) -> None:
    """Keep this process, which may host the store, until every rank has read the failure; a store that
    went away (its host has read it and ended) means the same."""
    deadline = time.monotonic() + timeout.total_seconds()
    with contextlib.suppress(RuntimeError):  # torch's DistNetworkError / DistStoreError
        while not store.check(["all read"]) and time.monotonic() < deadline:
            time.sleep(_POLL)


def _count_read(store) -> None:
    if store.add("read", 1) == torch.distributed.get_world_size():
        store.set("all read", "1")


def _watch(store, ended: threading.Event) -> None:
    """Until the step ends on this rank: if another rank records a failure, say it and end the process,
    wherever its main thread is blocked."""
    while not ended.wait(_POLL):
        if store.check(["failed"]):
            print(f"error: {_failure(store)}", file=sys.stderr, flush=True)
            _count_read(store)
            end_children()
            os._exit(1)

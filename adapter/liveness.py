"""A rank that stops answering ends the job; a rank that keeps everyone waiting is named.

Hangs. A collective whose peer is stalled (alive, silent, connections open) does not reliably end the job on
its own: on gloo the survivor's ``wait()`` on an asynchronous all-reduce outlives the group's timeout (the
collective thread's receive never returns), and where the timeout does raise, the interpreter's exit then
hangs in the process groups' destructors; NCCL and HCCL end it only through their own watchdogs, with
lines that name no megatron group. So every rank tracks the collectives it is in (torch.distributed's
collective functions) and the pipeline's sends and receives (megatron's ``_batched_p2p_ops`` and ``_p2p_ops``,
whose requests megatron waits on), each wrapped once through the patch registry when the flow starts
watching, and a watcher thread ends the process, whatever its main thread is blocked in, once one has lasted
``--distributed-timeout-minutes``, or at once when one fails. Before that, a rank whose collective has lasted a
quarter of the timeout records in the store that it arrived, so the one line each survivor prints names the
collective, its group, its ranks and those that never arrived (for a send or receive: its peers). Under
torchrun ``--max-restarts`` the group then restarts from the newest checkpoint.

Who starts it: megatron.training (scripts/pretrain_gpt.py, or Megatron-LM's pretrain_gpt.py through
``adapter.run``) once ``_initialize_distributed`` has made its groups (patches/liveness.py), with its
``--distributed-timeout-minutes``.

The watch ends with the groups it watches: the default group's ``destroy_process_group`` (the flow's exit,
scripts/pretrain_gpt.py's ``leave``) first stops the watcher, after the look it may be in, so no look ever
reads a torn-down group (a work's result, the store, the rank), and nothing in flight then is judged.
megatron.training never destroys its groups: there the interpreter's exit (``atexit``, which runs before the
groups' destructors) stops it, whichever way the run ends (``sys.exit`` of its exit paths, an error).

Stragglers. Every log interval the ranks gather each one's mean time per iteration spent outside the
collectives it waited in (the time the others wait for it); rank 0 names a rank whose time was more than
``STRAGGLER_RATIO`` times the median of the others' (and ``STRAGGLER_MIN_EXCESS_S`` more) for
``STRAGGLER_INTERVALS`` log intervals in a row.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import inspect
import itertools
import os
import statistics
import sys
import threading
import time
import types

import psutil
import torch

import adapter
from adapter import backend, device

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "gather_object",
               "scatter_object_list", "reduce_scatter",
               "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "reduce", "barrier", "all_to_all",
               "all_to_all_single", "gather", "scatter", "_all_gather_base", "_reduce_scatter_base")
# megatron's pipeline sends and receives, both ways it posts them (batched or not), with its keywords
_P2P = "megatron.core.pipeline_parallel.p2p_communication"
_P2P_FUNCTIONS = ("_batched_p2p_ops", "_p2p_ops")
_P2P_PARTS = (("tensor_recv_prev", "receive from", "prev_pipeline_rank"),
              ("tensor_send_prev", "send to", "prev_pipeline_rank"),
              ("tensor_recv_next", "receive from", "next_pipeline_rank"),
              ("tensor_send_next", "send to", "next_pipeline_rank"))
STRAGGLER_RATIO, STRAGGLER_INTERVALS, STRAGGLER_MIN_EXCESS_S = 1.5, 3, 0.1
_POLL = 0.25  # seconds between the watcher's looks
_lock = threading.Lock()
_ending = threading.Lock()
_inflight: dict[int, dict] = {}  # token -> the collective: name, group, seq, start, work (asynchronous ones)
_ids = itertools.count()
_seqs: dict[str, itertools.count] = {}  # group name -> this rank's count of collectives on it
_group_names: dict = {}  # process group -> its name (groups live as long as the run)
_waited = [0.0]  # seconds this rank spent inside synchronous collectives
_timeout_minutes = [0.0]
_timeout_flag = [""]  # the flag that set the timeout, with its value, for the line
_watcher: list[threading.Thread] = []
_at_exit: list = []  # the interpreter's exit stops the watch (registered once)
_looking = threading.Lock()  # held by the watcher through each look, by ``stop`` to wait for one to end
_stopped = [threading.Event()]  # set when the watch ends (the current watcher's)
_queued = [False]  # NCCL / HCCL: a collective called without async_op returns once queued on the device


def watch(timeout_minutes: float) -> None:
    """Track the collectives and the pipeline's sends and receives from now on, and start the watcher (once
    per process)."""
    if _watcher:
        return
    _queued[0] = backend.current().is_accelerator
    if adapter.registry.status("torch.distributed:destroy_process_group") != "applied":  # a watch after a stop
        with adapter.registry.together():
            _register_tracking()
    if not _at_exit:
        atexit.register(stop)
        _at_exit.append(stop)
    _stopped[0] = threading.Event()
    _watcher.append(threading.Thread(target=_watch, args=(timeout_minutes, _stopped[0]), daemon=True,
                                     name="adapter-liveness"))
    _watcher[0].start()


def _register_tracking() -> None:
    """The registry entries of the watch: the collectives, the pipeline's sends and receives, the teardown."""
    reason = "a collective a stalled rank never joins ends the job within the timeout, named (adapter.liveness)"
    for name in COLLECTIVES:
        if hasattr(torch.distributed, name):
            adapter.registry.wrap(f"torch.distributed:{name}", functools.partial(_tracked, name=name),
                                  reason=reason, versions=adapter.registry.supported)
    for name in _P2P_FUNCTIONS:
        adapter.registry.wrap(f"{_P2P}:{name}", _tracked_p2p, versions=adapter.registry.supported,
                              reason="a pipeline send or receive a stalled stage never answers ends the job, named")
    adapter.registry.wrap("torch.distributed:destroy_process_group", _stopping_first,
                          versions=adapter.registry.supported,
                          reason="the hang watcher's watch ends before the groups it watches are torn down")


def watching() -> bool:
    """Whether the watch is on (the collectives are tracked, so the straggler check can tell waits apart)."""
    return bool(_watcher)


def retime(seconds: float, flag: str) -> None:
    """Judge by a new timeout from now on: the process groups' own timeouts were set to ``seconds`` (megatron's
    ``--distributed-timeout-seconds-after-init``), and gloo's would otherwise raise in a ``wait()`` first."""
    _timeout_minutes[0], _timeout_flag[0] = seconds / 60, f"{flag} {seconds:g}"


def stop() -> None:
    """End the watch: wait for the look the watcher may be in (the groups still stand), stop it, and forget
    what was in flight (the run is over; nothing left is a hang). A later ``watch`` starts a new one."""
    if not _watcher:
        return
    _stopped[0].set()
    with _looking:
        pass
    if _watcher[0] is not threading.current_thread():
        _watcher[0].join()
    _watcher.clear()
    with _lock:
        _inflight.clear()


def _stopping_first(destroy):
    """``destroy_process_group``: of the default group (no argument, or the world), after the watch ended."""

    @functools.wraps(destroy)
    def destroy_watched(group=None, *args, **kwargs):
        if group is None or group is torch.distributed.group.WORLD:
            stop()
        return destroy(group, *args, **kwargs)

    return destroy_watched


def _tracked(fn, name: str):
    """``fn`` noted in the in-flight table while it runs (and, when asynchronous, until its work is done).
    Where its ``group`` and ``async_op`` sit is found once here: a collective runs thousands of times a step."""
    parameters = list(inspect.signature(fn).parameters)
    positions = {key: parameters.index(key) for key in ("group", "async_op") if key in parameters}

    def argument(args: tuple, kwargs: dict, key: str):
        if key in kwargs:
            return kwargs[key]
        at = positions.get(key, len(args))
        return args[at] if at < len(args) else None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        token = _enter(name, argument(args, kwargs, "group") or torch.distributed.group.WORLD)
        start = time.monotonic()
        try:
            work = fn(*args, **kwargs)
        except Exception as exc:
            _end(token, exc)
            raise
        _waited[0] += time.monotonic() - start
        pending = _future(work) if work is not None and argument(args, kwargs, "async_op") else _on_device()
        with _lock:
            if pending is not None:
                _inflight[token]["work"] = pending
            else:
                _inflight.pop(token, None)
        if getattr(pending, "done_on_wait", False):
            return _Request(work, token, done_on_wait=True)
        return work

    return call


def _tracked_p2p(fn):
    """megatron's ``_batched_p2p_ops`` / ``_p2p_ops`` (keywords only), noted in the in-flight table until every
    request it posted is complete: megatron waits on them at once, or a micro-batch later when it overlaps.
    gloo completes a send or receive only in its ``wait()``, so a stalled peer leaves the entry to age; gloo's
    own timeout raises in that ``wait()``, which the requests handed back therefore answer with the line."""

    @functools.wraps(fn)
    def call(**kwargs):
        posted = [(what, kwargs[peer]) for tensor, what, peer in _P2P_PARTS if kwargs.get(tensor) is not None]
        name = "pipeline " + ", ".join(f"{what} rank {peer}" for what, peer in posted)
        token = _enter(name, kwargs["group"], peers=sorted({peer for _, peer in posted}))
        try:
            requests = fn(**kwargs)
        except Exception as exc:
            _end(token, exc)
            raise
        works = list(requests.values() if isinstance(requests, dict) else requests)
        with _lock:
            _inflight[token]["work"] = _done_when(lambda: all(w.is_completed() for w in works))
        if isinstance(requests, dict):
            return {key: _Request(work, token) for key, work in requests.items()}
        return [_Request(work, token) for work in requests]

    return call


class _Request:
    """A pipeline request (megatron only calls its ``wait()``) whose failing wait ends the process with the
    line, as a tracked collective's failure does. ``done_on_wait``: the request is the whole entry, and a wait
    that returned completes it (a work without a future, whose ``is_completed`` may never say so)."""

    __slots__ = ("work", "token", "done_on_wait")

    def __init__(self, work, token: int, done_on_wait: bool = False):
        self.work, self.token, self.done_on_wait = work, token, done_on_wait

    def wait(self, *args, **kwargs):
        try:
            result = self.work.wait(*args, **kwargs)
        except Exception as exc:
            if self.token in _inflight:  # not yet seen done by the watcher
                _end(self.token, exc)
            raise
        if self.done_on_wait:
            with _lock:
                _inflight.pop(self.token, None)
        return result

    def __getattr__(self, name: str):
        return getattr(self.work, name)


def _on_device():
    """What a synchronous collective left to wait for: on NCCL and HCCL it returned once queued on the current
    stream, so an event recorded after it tells when the device has run it (a stalled peer: never); on gloo it
    is done when it returns (None)."""
    if not _queued[0] or device.is_current_stream_capturing():  # a CUDA graph's collective runs at replay
        return None
    event = device.Event()
    event.record()
    return _done_when(event.query)


def _future(work):
    """The work's future (``done()``, ``value()`` raising its error: Work's own ``is_success`` and
    ``exception`` warn that they are deprecated), or, where a backend has none, a stand-in that is done
    once the work is completed or waited on (``done_on_wait``). Without the wait, entries of gloo's
    reduce_scatter_tensor (sequence parallelism's, every micro-batch) stayed in flight for good: the watcher
    ended a healthy run of more than ``--distributed-timeout-minutes`` as timed out."""
    if isinstance(work, torch.distributed.distributed_c10d._IllegalWork):  # inside a coalescing manager: the
        return None  # manager issues the collectives later, as one
    try:
        return work.get_future()
    except RuntimeError:  # gloo's reduce_scatter_tensor (torch 2.13), whose is_completed stays False once
        pending = _done_when(work.is_completed)  # waited on: the wait of the request handed back completes it
        pending.done_on_wait = True
        return pending


def _done_when(done):
    """A stand-in for a future that is done once ``done()`` says so and carries no error (what the watcher
    reads of an entry's work)."""
    return types.SimpleNamespace(done=done, value=lambda: None)


def _enter(name: str, group, peers: list[int] | None = None) -> int:
    group_name = _group_names.get(group) or _group_names.setdefault(
        group, torch.distributed.distributed_c10d._get_process_group_name(group))
    token = next(_ids)
    with _lock:
        seq = next(_seqs.setdefault(group_name, itertools.count()))
        _inflight[token] = {"name": name, "group": group, "group_name": group_name, "seq": seq, "peers": peers,
                            "start": time.monotonic(), "work": None, "arrived": peers is not None}
    return token


def _watch(timeout_minutes: float, stopped: threading.Event) -> None:
    """The watcher's loop: a look every ``_POLL`` seconds until ``stop``; a look that has begun ends before
    the groups are torn down (``_looking``)."""
    _timeout_minutes[0], _timeout_flag[0] = timeout_minutes, f"--distributed-timeout-minutes {timeout_minutes:g}"
    while not stopped.wait(_POLL):
        with _looking:
            if stopped.is_set():
                return
            _look(_deadline())


def _look(timeout: float) -> None:
    """One look at what is in flight. It ends a collective two looks before the timeout: the process group's
    own timeout (the same minutes, counted from a moment after the entry's start) raises inside a ``wait()``
    on an asynchronous one, which no wrapper sees, and would otherwise end the process with a traceback first."""
    now = time.monotonic()
    with _lock:
        entries = list(_inflight.items())
    for token, entry in entries:
        work = entry["work"]
        if work is not None and work.done():
            try:
                work.value()
            except Exception as exc:  # noqa: BLE001 - whatever failed it, the collective failed
                _end(token, exc)
            with _lock:
                _inflight.pop(token, None)
        elif now - entry["start"] > timeout:
            _end(token)
        elif now - entry["start"] > timeout / 4 and not entry["arrived"]:
            _store().set(_arrival_key(entry, torch.distributed.get_rank()), "1")
            entry["arrived"] = True


def _store():
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def _arrival_key(entry: dict, rank: int) -> str:
    return f"adapter/arrived/{entry['group_name']}/{entry['seq']}/{rank}"


def describe(entry: dict, rank: int) -> tuple[str, list[int]]:
    """(``all_reduce on the tensor model parallel group (ranks [0, 1])``, the ranks that did not arrive: for a
    pipeline send or receive, its peers)."""
    ranks = torch.distributed.get_process_group_ranks(entry["group"])
    desc = getattr(entry["group"], "group_desc", "") or entry["group_name"]
    label = "the world" if entry["group"] is torch.distributed.group.WORLD else f"the {_plain(desc)}"
    if entry["peers"] is not None:
        return f"{entry['name']} on {label} (ranks {ranks})", entry["peers"]
    store = _store()
    missing = [r for r in ranks if r != rank and not store.check([_arrival_key(entry, r)])]
    return f"{entry['name']} on {label} (ranks {ranks})", missing


def _plain(desc: str) -> str:
    """megatron's ``TENSOR_MODEL_PARALLEL_GROUP`` as ``tensor model parallel group``."""
    return desc.lower().replace("_", " ") if desc.isupper() else desc


def _deadline() -> float:
    """Seconds after which the watcher ends a collective (``_watch``)."""
    return _timeout_minutes[0] * 60 - 2 * _POLL


def _how(entry: dict, exc: BaseException | None) -> str:
    """``timed out after 60 s (--distributed-timeout-minutes 1)`` (the watcher's, or a library's own timeout
    error), or ``failed after 2 s (its error)``."""
    seconds = time.monotonic() - entry["start"]
    if exc is None or seconds >= 0.95 * _deadline():
        return f"timed out after {seconds:.0f} s ({_timeout_flag[0]})"
    return f"failed after {seconds:.0f} s ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"


def _end(token: int, exc: BaseException | None = None) -> None:
    """Say which collective, in which group, did not complete and who never came; end this process (its
    exit would hang in the process groups' destructors)."""
    _ending.acquire()  # the first to end it says it; another (the main thread, the watcher) waits for the exit
    rank = torch.distributed.get_rank()
    with _lock:
        entry = _inflight[token]
    how = _how(entry, exc)
    try:
        what, missing = describe(entry, rank)
        verb = "did not answer" if entry["peers"] is not None else "did not arrive"
        absent = f"rank{'s' if len(missing) != 1 else ''} {', '.join(map(str, missing))} {verb}" \
            if missing else "every rank arrived"
    except Exception as exc:  # the store itself is gone (its host died): say what is known
        what, absent = f"{entry['name']} on {entry['group_name']}", f"the store did not answer ({exc})"
    _say(f"error: rank {rank}: {what} {how}: {absent}; ending this process", sys.stderr)
    end_children()
    os._exit(1)


def _say(line: str, stream) -> None:
    """``line`` in one write: every rank's output shares torchrun's pipe, where print's separate write of the
    newline let another rank's line land inside this one (seen: a straggler line ending in rank 1's loss)."""
    stream.write(line + "\n")
    stream.flush()


def end_children() -> None:
    """``os._exit`` skips the clean-up that would end the processes this one started (megatron's
    checkpoint writer and its manager): end them, or they outlive the job."""
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()


class StragglerCheck:
    """Every log interval: gather each rank's mean time per iteration outside the collectives it waited in;
    rank 0 names a rank above the others for ``STRAGGLER_INTERVALS`` intervals in a row."""

    def __init__(self, log_interval: int):
        self.log_interval, self.streaks = log_interval, {}
        self.started, self.waited = time.monotonic(), _waited[0]

    def step(self, iteration: int) -> str | None:
        if iteration % self.log_interval:
            return None
        own = (time.monotonic() - self.started - (_waited[0] - self.waited)) / self.log_interval
        times = [torch.zeros(1, dtype=torch.float64) for _ in range(torch.distributed.get_world_size())]
        torch.distributed.all_gather(times, torch.tensor([own], dtype=torch.float64))
        self.started, self.waited = time.monotonic(), _waited[0]
        line = self._judge([t.item() for t in times], iteration)
        if line and torch.distributed.get_rank() == 0:
            _say(line, sys.stdout)
        return line

    def _judge(self, times: list[float], iteration: int) -> str | None:
        line = None
        for rank, own in enumerate(times):
            others = statistics.median(times[:rank] + times[rank + 1:]) if len(times) > 1 else own
            slow = own > STRAGGLER_RATIO * others and own - others > STRAGGLER_MIN_EXCESS_S
            self.streaks[rank] = self.streaks.get(rank, 0) + 1 if slow else 0
            if self.streaks[rank] == STRAGGLER_INTERVALS:
                line = (f"straggler: rank {rank} spent {own * 1000:.0f} ms per iteration outside collectives, "
                        f"{own / others:.1f}x the other ranks' median {others * 1000:.0f} ms, for the last "
                        f"{STRAGGLER_INTERVALS} log intervals (to iteration {iteration})")
        return line

"""The one place that knows the device: device-neutral calls for cpu, cuda and npu.

The adapter's own code calls these, and megatron modules reach them too: every megatron module (and every
module of a package given to ``adapter.route_cuda``) imports, as ``torch``, a view of torch whose ``cuda``
attribute is this module (``adapter.cuda_routing``, ``adapter.torch_view``). So
``torch.cuda.current_device()`` written in megatron lands here, and from here on torch.cuda, torch.npu or
the CPU, while ``torch.cuda`` itself stays untouched for every other library in the process.

CPU semantics, chosen so megatron's device code runs unchanged on CPU:
- ``current_device()`` is ``torch.device("cpu")``: factories and ``.to()`` accept it where megatron passes
  ``device=torch.cuda.current_device()`` (an integer would name an accelerator that is not there);
- ``is_available()`` is True: the backend's device (here the CPU) is there, so code written as
  ``if torch.cuda.is_available(): x = x.cuda()`` takes the path its author meant, with ``cuda`` meaning
  this backend's device as everywhere else in routed code. ``has_accelerator()`` is the adapter's own
  question (pinned memory, weight initialisation on the host, memory counters);
- the RNG is the CPU default generator, since dropout on CPU draws from it;
- synchronize is a no-op, memory counters read 0 (the CPU allocator keeps no such statistics).
"""

from __future__ import annotations

import contextlib
import time
import types

import torch

from adapter import backend as _backend


def _accel():
    """The backend's torch device module, or None on CPU."""
    b = _backend.current()
    return b.torch_module if b.is_accelerator else None


def is_available() -> bool:
    """``torch.cuda.is_available()`` in routed code: whether this backend's device is there. Always: a
    backend is chosen only when its device is, and on cpu the device is the CPU (see the module docstring)."""
    return True


def has_accelerator() -> bool:
    """Whether an accelerator (not the CPU) backs this process."""
    return _backend.current().is_accelerator


def device_count() -> int:
    accel = _accel()
    return accel.device_count() if accel else 1


def current_device():
    """The int index on cuda/npu; ``torch.device('cpu')`` on cpu (see the module docstring)."""
    accel = _accel()
    return accel.current_device() if accel else torch.device("cpu")


def torch_device(index: int | None = None) -> torch.device:
    """A ``torch.device`` for the current (or given) device of this backend."""
    accel = _accel()
    if accel is None:
        return torch.device("cpu")
    return torch.device(_backend.current().device_type,
                        accel.current_device() if index is None else index)


def set_device(device) -> None:
    accel = _accel()
    if accel:
        accel.set_device(device)


def synchronize(device=None) -> None:
    accel = _accel()
    if accel:
        accel.synchronize(device)


# ---------------------------------------------------------------- RNG of the device
def get_rng_state(device=None) -> torch.Tensor:
    accel = _accel()
    return accel.get_rng_state() if accel else torch.get_rng_state()


def set_rng_state(state: torch.Tensor, device=None) -> None:
    accel = _accel()
    if accel:
        accel.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def manual_seed(seed: int) -> None:
    accel = _accel()
    if accel:
        accel.manual_seed(seed)
    else:
        torch.manual_seed(seed)


def manual_seed_all(seed: int) -> None:
    accel = _accel()
    if accel:
        accel.manual_seed_all(seed)
    else:
        torch.manual_seed(seed)


def initial_seed() -> int:
    accel = _accel()
    return accel.initial_seed() if accel else torch.initial_seed()


random = types.SimpleNamespace(get_rng_state=get_rng_state, set_rng_state=set_rng_state,
                               manual_seed=manual_seed, manual_seed_all=manual_seed_all,
                               initial_seed=initial_seed)


# ---------------------------------------------------------------- memory
def _memory_counter(name: str):
    def counter(device=None):
        accel = _accel()
        return getattr(accel, name)(device) if accel else 0
    counter.__name__ = name
    return counter


memory_allocated = _memory_counter("memory_allocated")
max_memory_allocated = _memory_counter("max_memory_allocated")
memory_reserved = _memory_counter("memory_reserved")
max_memory_reserved = _memory_counter("max_memory_reserved")


def memory_stats(device=None) -> dict:
    accel = _accel()
    return accel.memory_stats(device) if accel else {}


def reset_peak_memory_stats(device=None) -> None:
    accel = _accel()
    if accel:
        accel.reset_peak_memory_stats(device)


OutOfMemoryError = torch.OutOfMemoryError


def empty_cache() -> None:
    accel = _accel()
    if accel:
        accel.empty_cache()


# torch.cuda.memory.<name> spellings (Megatron-LM 0.19's test utilities empty the cache that way)
memory = types.SimpleNamespace(
    empty_cache=empty_cache, memory_allocated=memory_allocated, memory_reserved=memory_reserved,
    max_memory_allocated=max_memory_allocated, max_memory_reserved=max_memory_reserved,
    memory_stats=memory_stats, reset_peak_memory_stats=reset_peak_memory_stats)


# ---------------------------------------------------------------- streams, events, ranges
class _CpuEvent(torch.cpu.Event):
    """torch.cpu.Event with the timing that megatron's timers expect of a device event."""

    def __init__(self, enable_timing: bool = False, **_ignored):
        super().__init__()
        self._stamp = None

    def record(self, stream=None):
        self._stamp = time.perf_counter()

    def elapsed_time(self, end: "_CpuEvent") -> float:
        return (end._stamp - self._stamp) * 1000.0


class _CpuStream(torch.cpu.Stream, torch.Stream):
    """The CPU's one stream. Work on the CPU runs in program order, so every stream megatron makes or asks
    for is this one: equal to the current stream (a "side stream" needs no ``record_stream``, for which
    torch has no CPU kernel: routed code's ``t.record_stream(s)`` does nothing, ``adapter.torch_view``) and
    with events complete when recorded (torch.cpu.Stream's record_event gives None, which megatron then
    waits on). It is also a ``torch.Stream`` (torch.cpu.Stream's methods first), the type torch's tensor
    methods take a stream as."""

    def __new__(cls):
        return torch.Stream.__new__(cls, device="cpu")

    def __init__(self):
        torch.cpu.Stream.__init__(self)

    def __eq__(self, other) -> bool:
        return isinstance(other, torch.cpu.Stream)

    __hash__ = torch.cpu.Stream.__hash__

    def record_event(self, event=None):
        event = event if event is not None else _CpuEvent()
        event.record(self)
        return event

    @property
    def device(self) -> torch.device:
        """Where the stream's work runs, as torch.cuda.Stream says (Megatron-FSDP reads it)."""
        return torch.device("cpu")


_CPU_STREAM = _CpuStream()


def _device_attr(name: str):
    accel = _accel()
    return getattr(accel if accel else torch.cpu, name)


def _index(device) -> int | None:
    """A device argument as the backend's device module takes it: megatron names CUDA ("cuda", "cuda:1")."""
    if isinstance(device, (str, torch.device)):
        return torch.device(device).index
    return device


class _MadeByTheBackend(type):
    """The type of ``Stream`` and ``Event`` below: a class, as torch.cuda's are, so megatron's annotations
    evaluated at import (0.19's megatron_fsdp class body: ``torch.cuda.Event | None``) and its isinstance
    checks work; constructing one gives the backend's own object (``make``), which is what runs."""

    def __call__(cls, *args, **kwargs):
        return cls.make(*args, **kwargs)

    def __instancecheck__(cls, obj):
        return isinstance(obj, cls.made())

    def __subclasscheck__(cls, other):
        return isinstance(other, type) and issubclass(other, cls.made())


class Stream(metaclass=_MadeByTheBackend):
    """torch.cuda.Stream: the backend's stream; on CPU its one stream."""

    @staticmethod
    def make(device=None, priority: int = 0, **kwargs):
        accel = _accel()
        if accel is None:
            return _CPU_STREAM
        return accel.Stream(device=_index(device), priority=priority, **kwargs)

    @staticmethod
    def made() -> tuple:
        return (_accel().Stream,) if _accel() is not None else (torch.cpu.Stream,)

    @staticmethod
    def priority_range() -> tuple[int, int]:
        """(lowest, highest) stream priority (0.19's high-priority communication stream asks it); the CPU's
        one stream has a single priority."""
        accel = _accel()
        ranged = getattr(getattr(accel, "Stream", None), "priority_range", None)
        return tuple(ranged()) if ranged else (0, 0)


class Event(metaclass=_MadeByTheBackend):
    """torch.cuda.Event: the backend's event; on CPU one that keeps the time it was recorded."""

    @staticmethod
    def make(*args, **kwargs):
        return _CpuEvent(*args, **kwargs) if _accel() is None else _accel().Event(*args, **kwargs)

    @staticmethod
    def made() -> tuple:
        return (_accel().Event,) if _accel() is not None else (torch.cpu.Event,)


def current_stream(device=None):
    accel = _accel()
    return accel.current_stream() if accel else _CPU_STREAM


def default_stream(device=None):
    accel = _accel()
    return accel.default_stream(device) if accel else _CPU_STREAM


def stream(s):
    return _device_attr("stream")(s)


def is_current_stream_capturing() -> bool:
    """Whether a graph is being captured on the current stream (0.19 skips router tracing and asserts
    outside capture): the backend's answer where it captures graphs, else False (nothing captures)."""
    accel = _accel()
    capturing = getattr(accel, "is_current_stream_capturing", None) if accel else None
    return bool(capturing()) if capturing else False


def device(index):
    """Context manager selecting a device index; nothing to select on CPU."""
    accel = _accel()
    return accel.device(index) if accel else contextlib.nullcontext()


# ---------------------------------------------------------------- names megatron reads at import or rarely
def _lazy_call(callable_, **_kwargs) -> None:
    """torch.cuda._lazy_call defers work until CUDA initialises; off CUDA there is nothing to wait for."""
    accel = _accel()
    if accel is not None and hasattr(accel, "_lazy_call"):
        accel._lazy_call(callable_)
    else:
        callable_()


def _lazy_init() -> None:
    """torch.cuda._lazy_init initialises CUDA; the backend's device module initialises itself."""
    accel = _accel()
    if accel is not None and hasattr(accel, "_lazy_init"):
        accel._lazy_init()


def get_device_capability(device=None) -> tuple[int, int]:
    """(major, minor) of an NVIDIA device; (0, 0) where there is none: no behaviour keyed to an NVIDIA
    architecture applies."""
    accel = _accel()
    getter = getattr(accel, "get_device_capability", None) if accel else None
    capability = getter(device) if getter else None
    return tuple(capability) if capability else (0, 0)


def _telemetry(name: str):
    def reading(device=None) -> int:
        accel = _accel()
        return getattr(accel, name)(device) if accel is not None and hasattr(accel, name) else 0
    reading.__name__ = name
    reading.__doc__ = f"torch.cuda.{name}: the backend's reading where it has one, else 0 (none to read)."
    return reading


temperature, power_draw, utilization, clock_rate, device_memory_used = map(
    _telemetry, ("temperature", "power_draw", "utilization", "clock_rate", "device_memory_used"))


_NO_NVTX = types.SimpleNamespace(range_push=lambda msg: None, range_pop=lambda: None,
                                 range=lambda *a, **k: contextlib.nullcontext(),
                                 mark=lambda msg: None)


def _cpu_answer(name: str):
    """What the cpu backend answers for a torch.cuda name torch.cpu lacks, or None."""
    if name.endswith("Tensor") and isinstance(getattr(torch, name, None), type):
        return getattr(torch, name)  # isinstance targets (torch.cuda.FloatTensor -> torch.FloatTensor)
    if name == "default_generators":
        return (torch.default_generator,)
    return None


def __getattr__(name: str):
    """Anything not routed above: the backend's own device module's, where it has it; torch.cuda's classes
    as they are (annotations and isinstance targets megatron names at import, never instantiated off
    CUDA: the features that would are refused where they are configured)."""
    accel = _accel()
    source = accel if accel is not None else torch.cpu
    if name.startswith("__"):
        raise AttributeError(name)
    if hasattr(source, name):
        return getattr(source, name)
    answer = _cpu_answer(name) if accel is None else None
    if answer is not None:
        return answer
    if name == "nvtx":
        return _NO_NVTX  # profiler ranges: nothing to mark without NVTX
    if isinstance(getattr(torch.cuda, name, None), type):
        return getattr(torch.cuda, name)
    raise AttributeError(
        f"megatron asked torch.cuda.{name}, which the adapter does not provide on the "
        f"{_backend.current().name} backend. Please report it with the traceback and the versions of "
        "torch and megatron-core.")

"""CUDA routing, the mechanism's view of torch: what a module that spells CUDA sees instead of torch, and
the mode that answers its tensor methods (part of ``adapter.cuda_routing``, which hands them out).

``adapter.cuda_routing`` gives every routed module (all of megatron on cpu and npu; a user's packages on
request) a *view* as its ``torch``: a module object sharing torch's namespace, except that ``torch.cuda``
is ``adapter.device``. Modules whose code holds a CUDA device string (``"cuda"``, ``"cuda:N"``) or
``"nccl"`` get the *strings* view, which also routes ``device=`` of tensor factories, ``torch.device(...)``,
``torch.autocast``/``torch.amp``'s ``device_type`` and ``backend="nccl"`` of ``torch.distributed``'s group
constructors (the latter only where the module spells ``"nccl"`` or hands a backend on); modules that only
hand a caller's backend name on to a group constructor get the *backend* view (``torch.distributed``'s
constructors mapped, nothing else). Other libraries, and ``torch`` itself, are untouched; so is the
``torch.distributed`` of every module that names no backend, where ``mock.patch("torch.distributed.x")``
still reaches it. A view's attributes cost what torch's cost (a dict lookup); only the group constructors
(called once per group) and the strings view's factories are wrappers, and only in the modules that spell
a device string or pass a backend on, none of which is per-layer code.

What lives in tensor methods (``t.cuda()``, ``t.to("cuda")``, ``t.is_cuda``, ``t.type() ==
"torch.cuda.FloatTensor"``, ``model.cuda()``) no view can reach: ``CudaCalls`` answers those, for the calls
one module's own code makes, while a function of that module runs (``adapter.cuda_routing`` wraps the
functions that spell them) or inside ``adapter.cuda_calls()``.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types

import torch
from torch.overrides import TorchFunctionMode

from adapter import backend, device, host_memory

# torch functions that take a ``device=`` keyword and appear with a literal CUDA device in megatron.
_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "as_tensor", "arange", "rand", "randn",
              "randint", "zeros_like", "ones_like", "empty_like", "full_like", "empty_strided", "eye",
              "linspace", "randperm")
# torch.distributed functions whose ``backend`` may name NCCL
_GROUP_CONSTRUCTORS = ("init_process_group", "new_group", "new_subgroups", "new_subgroups_by_enumeration")
_REAL_DEVICE = torch.device


def _is_cuda(dev) -> bool:
    if isinstance(dev, str):
        return dev == "cuda" or dev.startswith("cuda:")
    return isinstance(dev, _REAL_DEVICE) and dev.type == "cuda"


def route_device(dev):
    """Map a CUDA device (or a bare index, which names an accelerator) to this backend's device."""
    b = backend.current()
    if b.name == "cuda" or not (_is_cuda(dev) or (isinstance(dev, int) and not isinstance(dev, bool))):
        return dev
    if not b.is_accelerator:
        return _REAL_DEVICE("cpu")
    index = dev if isinstance(dev, int) else _REAL_DEVICE(dev).index
    return device.torch_device(index)


def route_device_type(device_type):
    """``"cuda"`` as an autocast / custom_fwd device type: this backend's."""
    return backend.current().device_type if device_type == "cuda" else device_type


def route_backend(name):
    """``"nccl"`` as a torch.distributed backend: this backend's collective library."""
    return backend.current().dist_backend if name == "nccl" else name


class _RoutedDeviceType(type):
    """``torch.device`` for a view: constructing routes a CUDA device, isinstance and annotations still
    mean torch.device (which cannot be subclassed)."""

    def __call__(cls, *args, **kwargs):
        # torch.device("cuda", torch.cuda.current_device()) and torch.device(f"cuda:{...current_device()}")
        # off an accelerator, where the current device is torch.device("cpu") (an int would name a CUDA
        # device): that device. megatron.training 0.19 spells the second.
        if len(args) == 2 and isinstance(args[1], _REAL_DEVICE):
            return route_device(args[1])
        if args and args[0] == "cuda:cpu" and not backend.current().is_accelerator:
            return _REAL_DEVICE("cpu")
        return route_device(_REAL_DEVICE(*args, **kwargs))

    def __instancecheck__(cls, obj):
        return isinstance(obj, _REAL_DEVICE)

    def __subclasscheck__(cls, other):
        return issubclass(other, _REAL_DEVICE)


class routed_device(metaclass=_RoutedDeviceType):  # noqa: N801 - stands for torch.device
    """torch.device, with CUDA devices mapped to this backend's."""


def _with_routed_keyword(fn, keyword: str, route, position: int | None = None):
    """``fn`` with its ``keyword`` argument (or the positional argument at ``position``) routed."""

    @functools.wraps(fn)
    def routed(*args, **kwargs):
        if keyword in kwargs:
            kwargs[keyword] = route(kwargs[keyword])
        elif position is not None and len(args) > position:
            args = (*args[:position], route(args[position]), *args[position + 1:])
        return fn(*args, **kwargs)

    return routed


class _View(types.ModuleType):
    """A module sharing ``source``'s namespace with some names replaced; names the source gains later
    (lazily imported submodules) are looked up there. ``live``: every name not replaced is looked up in
    ``source`` at each use rather than copied once, so that a patch of ``source`` applied after the view was
    made reaches its callers (torch.distributed's collectives, wrapped when a run starts its hang watch:
    adapter.liveness)."""

    def __init__(self, source: types.ModuleType, doc: str, replaced: dict, live: bool = False):
        super().__init__(source.__name__, doc)
        if not live:
            vars(self).update({k: v for k, v in vars(source).items() if k not in ("__doc__", "__getattr__")})
        vars(self).update(replaced)
        self.__dict__["_view_of"] = source

    def __getattr__(self, name):
        return getattr(self.__dict__["_view_of"], name)

    def __repr__(self):
        return f"<view of {self.__name__} for the adapter's {backend.current().name} backend: {self.__doc__}>"


@functools.lru_cache(maxsize=None)
def routed() -> types.ModuleType:
    """torch, with torch.cuda routed to adapter.device."""
    return _View(torch, "torch.cuda routed to adapter.device", {"cuda": device})


@functools.lru_cache(maxsize=None)
def routed_backend() -> types.ModuleType:
    """torch, with torch.cuda routed and ``backend="nccl"`` of torch.distributed's group constructors mapped:
    for a module that passes on a backend name it was given (``HyperCommGrid(backend="nccl")`` stores it for
    ``new_subgroups_by_enumeration``) without spelling it itself."""
    return _View(torch, "torch.cuda and backend='nccl' routed", {"cuda": device, "distributed": routed_distributed()})


def _as_at_call_time(module: types.ModuleType, name: str):
    """``module.name`` looked up when called, so a monkeypatch or ``mock.patch`` of it is still seen through a
    view (group constructors run once per group: the lookup costs nothing that matters)."""

    @functools.wraps(getattr(module, name))
    def call(*args, **kwargs):
        return getattr(module, name)(*args, **kwargs)

    return call


@functools.lru_cache(maxsize=None)
def routed_distributed() -> types.ModuleType:
    """torch.distributed, with ``backend="nccl"`` of its group constructors mapped to this backend's."""
    import torch.distributed as dist

    return _View(dist, "backend='nccl' routed", {
        name: _with_routed_keyword(_as_at_call_time(dist, name), "backend", route_backend)
        for name in _GROUP_CONSTRUCTORS if hasattr(dist, name)}, live=True)


@functools.lru_cache(maxsize=None)
def routed_amp() -> types.ModuleType:
    """torch.amp, with ``device_type="cuda"`` mapped to this backend's."""
    return _View(torch.amp, "device_type='cuda' routed", {
        "autocast": _with_routed_keyword(torch.amp.autocast, "device_type", route_device_type, 0),
        "custom_fwd": _with_routed_keyword(torch.amp.custom_fwd, "device_type", route_device_type),
        "custom_bwd": _with_routed_keyword(torch.amp.custom_bwd, "device_type", route_device_type)})


@functools.lru_cache(maxsize=None)
def routed_strings(distributed: bool = True) -> types.ModuleType:
    """torch, with torch.cuda routed and CUDA device strings mapped (see module doc); NCCL backend strings
    too unless ``distributed`` is False (a module that names no backend keeps the real torch.distributed,
    which ``mock.patch("torch.distributed.x")`` reaches)."""
    replaced = {name: _with_routed_keyword(getattr(torch, name), "device", route_device) for name in _FACTORIES}
    replaced.update(cuda=device, device=routed_device, amp=routed_amp(),
                    autocast=_with_routed_keyword(torch.autocast, "device_type", route_device_type, 0))
    if distributed:
        replaced["distributed"] = routed_distributed()
    return _View(torch, "torch.cuda, device='cuda' and backend='nccl' routed" if distributed else
                 "torch.cuda and device='cuda' routed", replaced)


# ------------------------------------------------------------------------------------ tensor methods
_CUDA_TYPE_NAMES = {torch.float32: "torch.cuda.FloatTensor", torch.float16: "torch.cuda.HalfTensor",
                    torch.bfloat16: "torch.cuda.BFloat16Tensor", torch.float64: "torch.cuda.DoubleTensor",
                    torch.int64: "torch.cuda.LongTensor", torch.int32: "torch.cuda.IntTensor",
                    torch.uint8: "torch.cuda.ByteTensor", torch.bool: "torch.cuda.BoolTensor"}
_IS_CUDA = torch.Tensor.is_cuda  # the getset descriptor; its __get__ is what a mode receives
_TORCH_PACKAGES = ("torch.", "adapter.torch_view")


def _on_this_device(tensor: torch.Tensor) -> bool:
    return tensor.device.type == backend.current().device_type and not host_memory.is_host(tensor)


def _cuda(func, args, kwargs):
    index = args[1] if len(args) > 1 else kwargs.get("device")
    target = device.torch_device(index if isinstance(index, int) else None)
    return args[0].to(target, non_blocking=kwargs.get("non_blocking", False),
                      memory_format=kwargs.get("memory_format", torch.preserve_format))


def _to(func, args, kwargs):
    args = tuple(route_device(a) if _is_cuda(a) else a for a in args)
    if "device" in kwargs:
        kwargs["device"] = route_device(kwargs["device"])
    return func(*args, **kwargs)


def _type(func, args, kwargs):
    tensor = args[0]
    if len(args) == 1 and not kwargs and _on_this_device(tensor) and tensor.dtype in _CUDA_TYPE_NAMES:
        return _CUDA_TYPE_NAMES[tensor.dtype]
    return func(*args, **kwargs)


def _pin_memory(func, args, kwargs):
    """A copy in host memory, as ``pin_memory()`` gives (megatron frees the source after); pinned only
    where an accelerator exists to pin it for."""
    if backend.current().is_accelerator:
        return func(*args, **kwargs)
    return host_memory.pinned(args[0].clone(memory_format=torch.preserve_format))


def _record_stream(func, args, kwargs):
    """Nothing to tie without an accelerator: the CPU's one stream runs in program order (torch has no CPU
    kernel for ``record_stream``)."""
    return func(*args, **kwargs) if backend.current().is_accelerator else None


_ANSWERS = {torch.Tensor.cuda: _cuda, torch.Tensor.to: _to, torch.Tensor.type: _type,
            torch.Tensor.pin_memory: _pin_memory, torch.Tensor.record_stream: _record_stream}
_ROUTED_KEYWORDS = ("device", "pin_memory")


def calling_module(depth: int = 1) -> str:
    """The module of the nearest caller, ``depth`` frames up, that is not torch's own code (``model.cuda()``
    reaches Tensor.cuda through torch.nn's frames: the caller is the one who wrote ``.cuda()``)."""
    frame = sys._getframe(depth + 1)
    while frame is not None and frame.f_globals.get("__name__", "").startswith(_TORCH_PACKAGES):
        frame = frame.f_back
    return frame.f_globals.get("__name__", "") if frame is not None else ""


class CudaCalls(TorchFunctionMode):
    """Answers the CUDA spellings that live in tensor methods, for calls that ``module``'s own code makes:
    ``t.cuda()`` and ``model.cuda()`` move to this backend's device, ``t.to("cuda")`` and ``device="cuda"``
    are routed, ``t.is_cuda`` says whether ``t`` is on this backend's device, ``t.type()`` gives the CUDA
    type name there (megatron dispatches on ``'torch.cuda.FloatTensor'``); without an accelerator, pinned
    memory (``t.pin_memory()``, ``pin_memory=True``) is ordinary host memory and ``t.record_stream(s)`` does
    nothing. Calls from any other module pass
    through as written, so the mode answers for no code it was not asked to: megatron's own functions
    are each routed by their own rule, not by a caller's mode.

    Every torch call inside passes through the mode (a dict lookup when it is not one of the above), so it
    is for set-up and once-per-step functions, never for per-layer code."""

    def __init__(self, module: str):
        super().__init__()
        self.module = module

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        answer = _ANSWERS.get(func)
        getter = getattr(func, "__self__", None) is _IS_CUDA
        if (answer is None and not getter and kwargs.keys().isdisjoint(_ROUTED_KEYWORDS)) or (
                calling_module() != self.module):
            return func(*args, **kwargs)
        if getter:
            return _on_this_device(args[0])
        if answer is not None:
            return answer(func, args, kwargs)
        if "device" in kwargs:
            kwargs["device"] = route_device(kwargs["device"])
        if kwargs.get("pin_memory") and not backend.current().is_accelerator:
            kwargs["pin_memory"] = False  # no accelerator to pin for: ordinary host memory
            return host_memory.pinned(func(*args, **kwargs))
        return func(*args, **kwargs)


def routes_tensor_calls(fn, module: str):
    """``fn`` run under ``CudaCalls(module)``: how ``adapter.cuda_routing`` wraps a function that spells CUDA
    in tensor methods. The original stays reachable as ``__wrapped__``."""

    @functools.wraps(fn)
    def routed_call(*args, **kwargs):
        with CudaCalls(module):
            return fn(*args, **kwargs)

    routed_call.__adapter_routed__ = module
    return routed_call


def cuda_calls():
    """``with adapter.cuda_calls(): model.cuda()`` — the tensor-method CUDA spellings of the calling module's
    own code in the block, answered for this backend (see ``CudaCalls``). For a script's top-level code;
    the functions of a package given to ``adapter.route_cuda`` get this by rule. A no-op on cuda."""
    if backend.current().name == "cuda":
        return contextlib.nullcontext()
    return CudaCalls(calling_module())

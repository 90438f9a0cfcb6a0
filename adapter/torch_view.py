"""Module-scoped views of torch for megatron modules that hard-code CUDA.

A view is a module object sharing torch's namespace, except that ``cuda`` is ``adapter.device``. The
registry installs one as the global name ``torch`` of each megatron module listed in
``patches/cuda_sites.py``, so that module's ``torch.cuda.*`` calls go to the adapter's device layer. Other
libraries, and the rest of megatron, keep the real torch: nothing global changes, and reverting puts the
real module back. Attribute lookups on a view cost what they cost on torch (a dict lookup).

Modules that also spell ``device="cuda"`` get the ``strings`` view, whose tensor factories map a CUDA
device argument to this backend's device. It is only installed on cpu and npu, and only on modules
whose factory calls are not on the per-layer hot path.
"""

from __future__ import annotations

import contextlib
import functools
import types

import torch
from torch.overrides import TorchFunctionMode

from adapter import backend, device

# torch functions that take a ``device=`` keyword and appear with a literal CUDA device in megatron.
_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "as_tensor", "arange", "rand", "randn",
              "randint", "zeros_like", "ones_like", "empty_like", "full_like")


def _is_cuda(dev) -> bool:
    if isinstance(dev, str):
        return dev == "cuda" or dev.startswith("cuda:")
    return isinstance(dev, torch.device) and dev.type == "cuda"


def route_device(dev):
    """Map a CUDA device (or a bare index, which names an accelerator) to this backend's device."""
    b = backend.current()
    if b.name == "cuda" or not (_is_cuda(dev) or isinstance(dev, int)):
        return dev
    if not b.is_accelerator:
        return torch.device("cpu")
    index = dev if isinstance(dev, int) else torch.device(dev).index
    return device.torch_device(index)


def _routing_factory(fn):
    @functools.wraps(fn)
    def factory(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = route_device(kwargs["device"])
        return fn(*args, **kwargs)
    return factory


def _autocast(device_type, *args, **kwargs):
    return torch.autocast(backend.current().device_type if device_type == "cuda" else device_type,
                          *args, **kwargs)


class _TorchView(types.ModuleType):
    """Falls back to torch for names torch gains after the view is made (lazily imported submodules)."""

    def __getattr__(self, name):
        return getattr(torch, name)

    def __repr__(self):
        return f"<torch view for the adapter's {backend.current().name} backend: {self.__doc__}>"


def _make_view(doc: str, route_strings: bool) -> types.ModuleType:
    view = _TorchView("torch", doc)
    namespace = vars(view)
    namespace.update({k: v for k, v in vars(torch).items() if k not in ("__doc__", "__getattr__")})
    namespace["cuda"] = device
    if route_strings:
        for name in _FACTORIES:
            namespace[name] = _routing_factory(getattr(torch, name))
        namespace["autocast"] = _autocast
    return view


@functools.lru_cache(maxsize=None)
def routed() -> types.ModuleType:
    """torch, with torch.cuda routed to adapter.device."""
    return _make_view("torch.cuda routed to adapter.device", route_strings=False)


@functools.lru_cache(maxsize=None)
def routed_strings() -> types.ModuleType:
    """torch, with torch.cuda routed and CUDA device arguments of tensor factories mapped."""
    return _make_view("torch.cuda and device='cuda' routed to adapter.device", route_strings=True)


_CUDA_TYPE_NAMES = {torch.float32: "torch.cuda.FloatTensor", torch.float16: "torch.cuda.HalfTensor",
                    torch.bfloat16: "torch.cuda.BFloat16Tensor"}


class CudaSpelledTensorCalls(TorchFunctionMode):
    """Answers the CUDA spellings that live in tensor methods, which no module view can reach:
    ``t.type()`` gives the CUDA type name for a tensor on this backend's device (megatron dispatches on
    'torch.cuda.FloatTensor'), ``t.cuda()`` moves to this backend's device, ``device='cuda'`` is routed."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            tensor = args[0]
            if tensor.device.type == backend.current().device_type and tensor.dtype in _CUDA_TYPE_NAMES:
                return _CUDA_TYPE_NAMES[tensor.dtype]
        elif func is torch.Tensor.cuda:
            index = args[1] if len(args) > 1 else kwargs.get("device")
            target = device.torch_device(index if isinstance(index, int) else None)
            return args[0].to(target, non_blocking=kwargs.get("non_blocking", False))
        elif "device" in kwargs:
            kwargs["device"] = route_device(kwargs["device"])
        return func(*args, **kwargs)

    @contextlib.contextmanager
    def paused(self):
        """Run a block without this mode, which must be the innermost one active: the per-layer code
        that a once-per-step function under the mode calls into (every torch call there would pass
        through Python)."""
        self.__exit__(None, None, None)
        try:
            yield
        finally:
            self.__enter__()


def cuda_spelled_tensor_calls(fn):
    """Registry wrapper: run ``fn`` with its tensor-method CUDA spellings answered for this backend.

    Every torch call inside ``fn`` passes through the mode, so this is for set-up functions and
    once-per-step functions, never for per-layer code."""

    @functools.wraps(fn)
    def routed_call(*args, **kwargs):
        with CudaSpelledTensorCalls():
            return fn(*args, **kwargs)

    return routed_call

"""Which machine we are on: cpu, cuda or npu, and what follows from it.

Chosen once per process from ``ADAPTER_BACKEND`` (cpu | cuda | npu), or automatically: npu where torch_npu
imports and reports a device, else cuda where available, else cpu.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import os

import torch

BACKEND_ENV = "ADAPTER_BACKEND"

DIST_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


class BackendUnavailable(RuntimeError):
    """The requested backend is not usable on this machine."""


@dataclasses.dataclass(frozen=True)
class Backend:
    name: str  # "cpu" | "cuda" | "npu"

    @property
    def dist_backend(self) -> str:
        """The torch.distributed backend: gloo, nccl or hccl."""
        return DIST_BACKENDS[self.name]

    @property
    def device_type(self) -> str:
        return self.name

    @property
    def is_accelerator(self) -> bool:
        return self.name != "cpu"

    @property
    def torch_module(self):
        """torch.cpu, torch.cuda or torch.npu: the device module of this backend."""
        return getattr(torch, self.name)


def _npu_problem() -> str | None:
    """Why the npu backend cannot be used here, or None when it can."""
    try:
        importlib.import_module("torch_npu")
    except Exception as exc:  # ImportError, or torch_npu's RuntimeError when CANN is missing
        return (f"torch_npu cannot be imported ({type(exc).__name__}: {exc}). Install CANN and the "
                f"torch_npu wheel built for torch {torch.__version__.split('+')[0]}, then source "
                "CANN's set_env.sh")
    npu = getattr(torch, "npu", None)
    if npu is None or not npu.is_available() or npu.device_count() == 0:
        return ("torch_npu imports but reports no NPU device. Check `npu-smi info` and "
                "ASCEND_RT_VISIBLE_DEVICES")
    return None


def _cuda_problem() -> str | None:
    if not torch.backends.cuda.is_built():
        return (f"this torch ({torch.__version__}) is a CPU-only build. Install a CUDA build of "
                "torch, e.g. from the PyTorch CUDA wheel index")
    if not torch.cuda.is_available():
        return "torch reports no CUDA device. Check `nvidia-smi` and CUDA_VISIBLE_DEVICES"
    return None


def _npu_installed() -> bool:
    return importlib.util.find_spec("torch_npu") is not None


def select_backend(requested: str | None = None) -> Backend:
    """Resolve ``requested`` (or ``$ADAPTER_BACKEND``; empty means automatic) to a usable backend."""
    if requested is None:
        requested = os.environ.get(BACKEND_ENV, "")
    requested = requested.strip().lower()
    if requested in ("", "auto"):
        if _npu_installed() and _npu_problem() is None:
            return Backend("npu")
        if _cuda_problem() is None:
            return Backend("cuda")
        return Backend("cpu")
    if requested not in DIST_BACKENDS:
        raise BackendUnavailable(
            f"{BACKEND_ENV}={requested!r} is not a backend. Use one of cpu, cuda, npu, or leave it "
            "unset to choose automatically.")
    problem = {"npu": _npu_problem, "cuda": _cuda_problem}.get(requested, lambda: None)()
    if problem:
        raise BackendUnavailable(
            f"{BACKEND_ENV}={requested} was asked for, but {problem}. Or set {BACKEND_ENV}=cpu.")
    return Backend(requested)


@functools.lru_cache(maxsize=None)
def current() -> Backend:
    """The backend of this process, chosen on first use and fixed from then on."""
    return select_backend()

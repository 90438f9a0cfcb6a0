"""Host memory told apart from the device's, on every backend: what megatron's offloading code asks of a tensor.

megatron's ``HybridDeviceOptimizer`` (``--optimizer-cpu-offload``) copies a fraction of the parameters to
pinned host memory and sorts every tensor by ``t.is_cuda``: device parameters step on the device, host
copies step on the CPU and are copied back. On cuda and npu a host copy is a tensor on device "cpu" and the
routed ``is_cuda`` (``adapter.torch_view``) answers False for it. On the cpu backend the device *is* host
memory, so a host copy cannot be told from a device tensor: it would step with the device parameters and
its update would never be copied back (patches/host_offload.py refuses offloading there).

A test still needs the NPU's path of that code to run on CPU before an NPU runs it. The host stand-in
(``ADAPTER_HOST_STAND_IN=1``, cpu backend only) gives it the distinction an accelerator has: a host copy that
routed megatron code makes (``t.pin_memory()``, a factory's ``pin_memory=True``) is a ``HostCopy``, an
ordinary CPU tensor whose type marks it as host memory and which every op on it keeps; the routed
``is_cuda`` answers False for it and True for every other tensor, as on an NPU. Everything else (streams,
events, ``.to("cuda")``) is the cpu backend's routing as always. A real cpu run leaves it off.
"""

from __future__ import annotations

import os

import torch

from adapter import backend

STAND_IN_ENV = "ADAPTER_HOST_STAND_IN"


class HostCopy(torch.Tensor):
    """A CPU tensor standing for pinned host memory under the host stand-in (``torch.Tensor``'s own
    ``__torch_function__`` keeps the type through every op, so moments made ``zeros_like`` it are host too)."""


def stand_in() -> bool:
    """Whether host copies are told apart on the cpu backend (read per call: tests switch it per process)."""
    return os.environ.get(STAND_IN_ENV, "") == "1" and not backend.current().is_accelerator


def pinned(tensor: torch.Tensor) -> torch.Tensor:
    """A pinned host tensor as routed code gets it on a backend without an accelerator: ``tensor`` itself as a
    ``HostCopy`` under the stand-in, else as it is (ordinary host memory: nothing to pin for)."""
    return tensor.as_subclass(HostCopy) if stand_in() else tensor


def is_host(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` lives in host memory rather than on this backend's device: on cpu and npu a tensor
    on "cpu"; on the cpu backend a ``HostCopy`` (without the stand-in there is no host memory apart from the
    device's, and this answers False)."""
    if backend.current().is_accelerator:
        return tensor.device.type == "cpu"
    return isinstance(tensor, HostCopy)

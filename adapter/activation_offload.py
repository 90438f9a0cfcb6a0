"""Fine-grained activation offloading (``--fine-grained-activation-offloading``) off CUDA: what megatron's
offload manager (``megatron.core.pipeline_parallel.fine_grained_activation_offload``) needs that names CUDA.

The manager saves the inputs of chosen modules to pinned host memory on a side stream after their forward and
copies them back before their backward. Its streams, events and pinned buffers are ``torch.cuda`` calls and
``device=``/``pin_memory=`` arguments, routed like the rest of megatron (``adapter.cuda_routing``): on npu
they are torch.npu's, on cpu the CPU's one stream, so the copies run in place, in program order. Two things
are not routing:

- which tensors it may offload: megatron asks ``tensor.device.type == "cuda"``, so off CUDA it offloads
  nothing. ``can_manage`` asks for this backend's device instead (and, under the host stand-in of
  ``adapter.host_memory``, not a host copy);
- Transformer Engine's flag that tells TE's layers they run inside an offload context: megatron refuses to
  enter the context without TE. Without TE no layer reads the flag, so ``TE_FLAG`` is a namespace holding it.
"""

from __future__ import annotations

import types

import torch

from adapter import backend, host_memory

TE_FLAG = types.SimpleNamespace(CPUOffloadEnabled=False)


def can_manage(tensor: torch.Tensor) -> bool:
    """``ChunkOffloadHandler._can_manage_tensor_for_offload``: an activation on this backend's device, not a
    parameter nor one of torch's tracing tensors (fake, functional), as megatron's own check says on CUDA."""
    tracing = isinstance(tensor, (torch._subclasses.fake_tensor.FakeTensor,
                                  torch._subclasses.functional_tensor.FunctionalTensor))
    return (not isinstance(tensor, torch.nn.Parameter) and not tracing
            and tensor.device.type == backend.current().device_type and not host_memory.is_host(tensor))

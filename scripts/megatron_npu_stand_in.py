"""A stand-in ``torch.npu`` device module for ``run_megatron_tests.py --backend npu`` on a machine without
an NPU: a routing check, not an NPU run.

The torch_npu double (tests/doubles) deliberately registers no device, so the adapter's npu backend
would refuse to start. This names torch's PrivateUse1 backend "npu" (as torch_npu does), registers a
device module that answers the device-layer calls (one device per rank, the CPU generator as its RNG)
together with torch's Python-backend hooks and device guard, and registers "hccl" with
torch.distributed as gloo, so ranks form their groups. Tensors cannot live on this "npu" (it has no
kernels): a test that allocates there fails with "Could not run ... from the 'npu' backend", which shows that its CUDA
spelling reached the NPU; one that fails naming CUDA shows a site left unrouted.
"""

from __future__ import annotations

import types

import torch


def _device_module(device_count: int) -> types.ModuleType:
    state = {"device": 0}
    npu = types.ModuleType("torch.npu")
    npu.is_available = lambda: True
    npu.device_count = lambda: device_count
    npu.current_device = lambda: state["device"]
    npu.set_device = lambda d: state.update(device=d if isinstance(d, int) else torch.device(d).index or 0)
    npu.synchronize = lambda device=None: None
    npu.get_rng_state = lambda device=None: torch.get_rng_state()
    npu.set_rng_state = lambda s, device=None: torch.set_rng_state(s)
    npu.manual_seed = npu.manual_seed_all = lambda seed: torch.manual_seed(seed)
    npu.initial_seed = torch.initial_seed
    for counter in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        setattr(npu, counter, lambda device=None: 0)
    npu.memory_stats = lambda device=None: {}
    npu.reset_peak_memory_stats = npu.empty_cache = lambda device=None: None
    return npu


def _gloo_as_hccl(store, rank, size, timeout):
    import torch.distributed as dist

    return dist.ProcessGroupGloo(store, rank, size, timeout)


def install(device_count: int) -> None:
    """Before ``import adapter``: torch.npu answers, and init_process_group(backend="hccl") gives gloo."""
    import torch.distributed as dist

    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    # torch's own code asks the accelerator's hooks (barrier() calls torch._C._get_accelerator()): the
    # Python-backend set-up registers stand-in hooks and a device guard along with the module
    _setup_privateuseone_for_python_backend(rename="npu", backend_module=_device_module(device_count))
    dist.Backend.register_backend("hccl", _gloo_as_hccl, devices=["cpu", "npu"])

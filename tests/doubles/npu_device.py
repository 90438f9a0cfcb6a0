"""A stand-in for the ``torch.npu`` device module that torch_npu registers, for tests that need torch to
report an NPU (the torch_npu double itself deliberately registers none): ``register()`` names torch's
PrivateUse1 backend "npu" and registers a module answering the device queries the adapter's backend
choice and device layer ask."""

import types

import torch


def register(device_count: int = 1, current_device: int = 0) -> types.ModuleType:
    npu = types.ModuleType("torch.npu")
    npu.is_available = lambda: True
    npu.device_count = lambda: device_count
    npu.current_device = lambda: current_device
    torch.utils.rename_privateuse1_backend("npu")
    torch._register_device_module("npu", npu)
    return npu

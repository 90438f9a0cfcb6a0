"""CUDA routing, the registry entries: every megatron module's CUDA spellings go to the adapter's device
layer on cpu and npu, by rule (the mechanism: ``adapter/cuda_routing.py``).

One ``route`` patch covers the whole ``megatron`` package (megatron.core, and megatron.training /
megatron.legacy from a Megatron-LM checkout), whichever modules a release has: ``torch.cuda.*`` and
import-time CUDA checks, device and backend strings, and tensor-method spellings (``adapter.cuda_routing``).
tests/test_cuda_inventory.py accounts for every CUDA site of the installed megatron-core. On cuda
nothing is installed: megatron runs as written.
"""

from adapter import cuda_routing


def register(registry, versions: str) -> None:
    registry.route("megatron", cuda_routing.Router(), versions=versions, backends=("cpu", "npu"),
                   reason="megatron spells CUDA in ~600 places in 100+ modules; each module gets this "
                          "backend's device, whichever module it is")

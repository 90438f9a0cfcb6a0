"""Run megatron-core unchanged on NVIDIA GPUs, Ascend NPUs and plain CPUs.

``import adapter`` before (or after) megatron: it picks the backend (``ADAPTER_BACKEND`` or automatic),
registers the patch table in ``patches/`` and applies each patch when its megatron module is imported.
"""

from adapter import backend as _backend
from adapter.backend import Backend, BackendUnavailable
from adapter.parallel import ParallelConfigError, check_sizes, init_distributed
from adapter.torch_view import cuda_calls
from adapter.registry import PatchError, PatchRegistry, PatchTargetError, PatchVersionError

__all__ = ["Backend", "BackendUnavailable", "ParallelConfigError", "PatchError", "PatchRegistry",
           "PatchTargetError", "PatchVersionError", "apply", "check_sizes", "cuda_calls", "current_backend",
           "import_own", "init_distributed", "registry", "revert", "route_cuda", "unroute_cuda"]


def current_backend() -> Backend:
    """The backend of this process (cpu, cuda or npu)."""
    return _backend.current()


def route_cuda(*packages: str) -> None:
    """Give your own packages the routing megatron gets: in every module of each package, imported before
    or after this call, ``torch.cuda.*``, ``device="cuda"``, ``.cuda()`` / ``.to("cuda")`` / ``.is_cuda``
    in its functions, and ``backend="nccl"`` answer for this backend's device (cpu, npu); nothing outside
    those modules changes, ``torch.cuda`` included. A no-op on cuda. See README "Your own CUDA code"."""
    from adapter import cuda_scope

    for package in packages:
        cuda_scope.route(package, who="user")


def unroute_cuda(*packages: str) -> None:
    """Undo ``route_cuda`` for these packages."""
    from adapter import cuda_scope

    for package in packages:
        cuda_scope.unroute(package, who="user")


registry = PatchRegistry(backend=lambda: _backend.current().name)
apply = registry.apply
revert = registry.revert

current_backend()  # an unusable ADAPTER_BACKEND fails here, at import, not inside megatron

from adapter import quiet_warnings  # noqa: E402

quiet_warnings.install()  # before the patches import megatron: its import-time fallbacks are answered

from adapter.own_packages import import_own  # noqa: E402 - the table needs the registry above

import_own("patches").register_all(registry)
import_own("models")  # decided now, while sys.path is the one the user's script started with
apply()

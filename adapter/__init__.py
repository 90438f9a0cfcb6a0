"""Run megatron-core unchanged on NVIDIA GPUs, Ascend NPUs and plain CPUs.

``import adapter`` before (or after) megatron: it picks the backend (``ADAPTER_BACKEND`` or automatic),
registers the patch table in ``patches/`` and applies each patch when its megatron module is imported.
"""

from adapter import backend as _backend
from adapter.backend import Backend, BackendUnavailable
from adapter.parallel import ParallelConfigError, check_sizes, init_distributed
from adapter.registry import PatchError, PatchRegistry, PatchTargetError, PatchVersionError

__all__ = ["Backend", "BackendUnavailable", "ParallelConfigError", "PatchError", "PatchRegistry",
           "PatchTargetError", "PatchVersionError", "apply", "check_sizes", "current_backend",
           "import_own", "init_distributed", "registry", "revert"]


def current_backend() -> Backend:
    """The backend of this process (cpu, cuda or npu)."""
    return _backend.current()


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

"""Run megatron-core unchanged on NVIDIA GPUs, Ascend NPUs and plain CPUs.

``import adapter`` before (or after) megatron: it picks the backend (``ADAPTER_BACKEND`` or automatic),
registers the patch table in ``patches/`` and applies each patch when its megatron module is imported.
"""

import sys as _sys

from adapter import backend as _backend
from adapter.backend import Backend, BackendUnavailable
from adapter.parallel import ParallelConfigError, check_sizes, init_distributed
from adapter.torch_view import cuda_calls
from adapter.registry import PatchError, PatchRegistry, PatchTargetError, PatchVersionError

__all__ = ["Backend", "BackendUnavailable", "ParallelConfigError", "PatchError", "PatchRegistry",
           "PatchTargetError", "PatchVersionError", "apply", "check_sizes", "cuda_calls", "current_backend",
           "init_distributed", "registry", "revert", "route_cuda", "unroute_cuda"]


def current_backend() -> Backend:
    """The backend of this process (cpu, cuda or npu)."""
    return _backend.current()


def route_cuda(*packages: str) -> None:
    """Give your own packages the routing megatron gets: in every module of each package, imported before
    or after this call, ``torch.cuda.*``, ``device="cuda"`` (given to torch's factories, torch.nn's modules
    or the module's own helpers), ``.cuda()`` / ``.to("cuda")`` / ``.is_cuda`` in its functions, and
    ``backend="nccl"`` answer for this backend's device (cpu, npu); nothing outside
    those modules changes, ``torch.cuda`` included. A no-op on cuda. See README "Your own CUDA code"."""
    from adapter import cuda_routing

    for package in packages:
        cuda_routing.route(package, who="user")


def unroute_cuda(*packages: str) -> None:
    """Undo ``route_cuda`` for these packages."""
    from adapter import cuda_routing

    for package in packages:
        cuda_routing.unroute(package, who="user")


registry = PatchRegistry(backend=lambda: _backend.current().name)
apply = registry.apply
revert = registry.revert


def _refused_at_import(check) -> None:
    """Run an import-time check. Under ``python -m adapter``, the report a user runs to see what is wrong,
    its refusal is that one line and exit status 1 (the package is imported before the report's code
    can catch anything); in a program it raises as usual."""
    try:
        check()
    except (BackendUnavailable, PatchVersionError) as exc:
        if _sys.argv[:1] == ["-m"] and _sys.orig_argv[_sys.orig_argv.index("-m") + 1:][:1] == ["adapter"]:
            raise SystemExit(f"python -m adapter: {exc}") from None
        raise


_refused_at_import(current_backend)  # an unusable ADAPTER_BACKEND fails here, not inside megatron

from adapter import compile_probe  # noqa: E402

compile_probe.start_if_requested()  # beside the imports below, where the entry point asked for it

from adapter import quiet_warnings  # noqa: E402

quiet_warnings.install()  # before the patches import megatron: its import-time fallbacks are answered

from adapter import own_packages  # noqa: E402

own_packages.check_plain_names()  # a user's own `patches` / `models` first on sys.path: one line, now

import patches  # noqa: E402 - the table needs the registry above; the one import upward (.importlinter)

_refused_at_import(lambda: patches.register_all(registry))  # megatron-core's release too
apply()

"""Parallel start-up and process groups, the registry entries: size checks before any group exists, and HCCL
options per group on NPU (the mechanism: ``adapter/parallel.py``)."""

from adapter import parallel

_STATE = "megatron.core.parallel_state"


def register(registry, versions: str) -> None:
    registry.wrap(f"{_STATE}:initialize_model_parallel", parallel.checked_initialize_model_parallel,
                  versions=versions,
                  reason="refuse impossible layouts with the fix, before half the groups exist")
    registry.replace(f"{_STATE}:get_nccl_options", parallel.hccl_group_options, versions=versions,
                     backends=("npu",),
                     reason="HCCL groups need HCCL options (per-group buffer size and name)")

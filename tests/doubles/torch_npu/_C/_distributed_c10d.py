"""Double of ``torch_npu._C._distributed_c10d``: the HCCL process-group options.

From ../shared/reference/torch_npu.md ("HCCL in torch.distributed")::

    opts = torch_npu._C._distributed_c10d.ProcessGroupHCCL.Options()
    opts.hccl_config = {"hccl_buffer_size": 200, "group_name": "tp"}
    torch.distributed.new_group(..., pg_options=opts)

Keys: hccl_buffer_size (MB), group_name (<= 32 chars), qos_service_level, qos_traffic_class,
hccl_op_expansion_mode (0-3). On the real (pybind) class, reading ``hccl_config`` returns a copy of the
C++ map, so ``opts.hccl_config["k"] = v`` is silently lost: copy, modify, reassign. The double keeps that
trap and, stricter than the real class, refuses unknown keys and ill-typed values when assigned, so a
test fails where an NPU run would misbehave quietly.
"""

from __future__ import annotations

GROUP_NAME_MAX = 32
_INT_KEYS = ("hccl_buffer_size", "qos_service_level", "qos_traffic_class", "hccl_op_expansion_mode")
HCCL_CONFIG_KEYS = frozenset(_INT_KEYS + ("group_name",))


def _check_config(config) -> dict:
    if not isinstance(config, dict):
        raise TypeError(f"hccl_config must be a dict, got {type(config).__name__}")
    unknown = set(config) - HCCL_CONFIG_KEYS
    if unknown:
        raise ValueError(f"unknown hccl_config keys {sorted(unknown)}; known: {sorted(HCCL_CONFIG_KEYS)}")
    for key in _INT_KEYS:
        if key in config:
            value = config[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise TypeError(f"hccl_config[{key!r}] must be a non-negative int, got {value!r}")
    if "hccl_buffer_size" in config and config["hccl_buffer_size"] < 1:
        raise ValueError(f"hccl_config['hccl_buffer_size'] must be >= 1 MB, got {config['hccl_buffer_size']}")
    if config.get("hccl_op_expansion_mode", 0) > 3:
        raise ValueError("hccl_config['hccl_op_expansion_mode'] must be 0-3, "
                         f"got {config['hccl_op_expansion_mode']}")
    if "group_name" in config:
        name = config["group_name"]
        if not isinstance(name, str):
            raise TypeError(f"hccl_config['group_name'] must be a str, got {name!r}")
        if len(name) > GROUP_NAME_MAX:
            raise ValueError(f"hccl_config['group_name'] {name!r} is longer than {GROUP_NAME_MAX} chars")
    return dict(config)


class ProcessGroupHCCL:
    """Only the options are modelled: the double cannot create HCCL process groups."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError("the torch_npu test double cannot create HCCL process groups")

    class Options:
        def __init__(self, is_high_priority_stream: bool = False):
            self.is_high_priority_stream = is_high_priority_stream
            self._hccl_config: dict = {}

        @property
        def hccl_config(self) -> dict:
            """A copy, as pybind returns one: updating it in place does not reach the options."""
            return dict(self._hccl_config)

        @hccl_config.setter
        def hccl_config(self, config: dict) -> None:
            self._hccl_config = _check_config(config)

        def __repr__(self):
            return f"ProcessGroupHCCL.Options(hccl_config={self._hccl_config!r})"

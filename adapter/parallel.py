"""Distributed start-up on the adapter's backend: process group, parallel sizes, HCCL group options."""

from __future__ import annotations

import datetime
import functools
import math
import os

import torch

from adapter import backend, device

TIMEOUT_ENV = "ADAPTER_DIST_TIMEOUT_MINUTES"
DEFAULT_TIMEOUT_MINUTES = 30.0
DEFAULT_HCCL_BUFFER_MB = 200  # HCCL's own default when HCCL_BUFFSIZE is unset
_HCCL_KEYS = ("hccl_buffer_size", "qos_service_level", "qos_traffic_class", "hccl_op_expansion_mode")
_NCCL_ONLY_KEYS = ("is_high_priority_stream", "cga_cluster_size", "max_ctas", "min_ctas", "net_name")


class ParallelConfigError(ValueError):
    """A parallel layout that cannot work, refused before any process group is created."""


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ParallelConfigError(f"{name}={value!r}: parallel sizes are whole numbers >= 1")
    return value


def check_sizes(world_size: int, *, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
                etp: int | None = None, vpp: int | None = None,
                num_attention_heads: int | None = None, num_query_groups: int | None = None,
                num_layers: int | None = None) -> int:
    """Refuse a layout that cannot work, with the fix in the message; return the data-parallel size.

    Model sizes are optional: initialize_model_parallel knows only the parallel sizes, a training flow
    also knows the model and should pass it."""
    for name, value in (("world_size", world_size), ("tensor_model_parallel_size", tp),
                        ("pipeline_model_parallel_size", pp), ("context_parallel_size", cp),
                        ("expert_model_parallel_size", ep)):
        _positive(name, value)
    etp = tp if etp is None else _positive("expert_tensor_parallel_size", etp)
    model = tp * pp * cp
    if world_size % model:
        raise ParallelConfigError(
            f"world size {world_size} is not divisible by tensor ({tp}) x pipeline ({pp}) x context "
            f"({cp}) parallel = {model}. Launch a multiple of {model} processes, or change the sizes.")
    dp = world_size // model
    expert = etp * ep * pp
    if world_size % expert:
        raise ParallelConfigError(
            f"world size {world_size} is not divisible by expert tensor ({etp}) x expert ({ep}) x "
            f"pipeline ({pp}) parallel = {expert}. Change expert_model_parallel_size or "
            "expert_tensor_parallel_size.")
    if vpp is not None:
        _positive("virtual_pipeline_model_parallel_size", vpp)
        if pp < 2:
            raise ParallelConfigError(
                f"virtual pipeline size {vpp} needs pipeline_model_parallel_size > 1 (got {pp}). "
                "Drop the virtual pipeline size or use a pipeline.")
    if num_attention_heads is not None:
        if num_attention_heads % tp:
            raise ParallelConfigError(
                f"tensor parallel size {tp} does not divide the {num_attention_heads} attention heads. "
                f"Use a tensor parallel size that divides {num_attention_heads}.")
        groups = num_query_groups or num_attention_heads
        if groups % tp:
            raise ParallelConfigError(
                f"tensor parallel size {tp} does not divide the {groups} query groups (GQA). Use a "
                f"tensor parallel size that divides {groups}.")
    if num_layers is not None:
        stages = pp * (vpp or 1)
        if num_layers % stages:
            raise ParallelConfigError(
                f"{num_layers} layers cannot be split evenly over pipeline ({pp}) x virtual pipeline "
                f"({vpp or 1}) = {stages} stages. Choose sizes whose product divides {num_layers}.")
    return dp


def checked_initialize_model_parallel(initialize_model_parallel):
    """Registry wrapper: check megatron's sizes against the world before any group is created."""

    @functools.wraps(initialize_model_parallel)
    def initialize(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                   virtual_pipeline_model_parallel_size: int | None = None, *args, **kwargs):
        if not torch.distributed.is_initialized():
            raise ParallelConfigError(
                "initialize_model_parallel needs torch.distributed first: call "
                "adapter.init_distributed() (or torch.distributed.init_process_group) before it.")
        check_sizes(torch.distributed.get_world_size(), tp=tensor_model_parallel_size,
                    pp=pipeline_model_parallel_size, vpp=virtual_pipeline_model_parallel_size,
                    cp=kwargs.get("context_parallel_size", 1),
                    ep=kwargs.get("expert_model_parallel_size", 1),
                    etp=kwargs.get("expert_tensor_parallel_size"))
        return initialize_model_parallel(tensor_model_parallel_size, pipeline_model_parallel_size,
                                         virtual_pipeline_model_parallel_size, *args, **kwargs)

    return initialize


def timeout_minutes(requested: float | None = None) -> float:
    """The collective timeout in minutes: ``requested``, else $ADAPTER_DIST_TIMEOUT_MINUTES, else 30."""
    if requested is not None:
        source, raw = "timeout", requested
    else:
        source, raw = TIMEOUT_ENV, os.environ.get(TIMEOUT_ENV)
        if raw is None:
            return DEFAULT_TIMEOUT_MINUTES
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = -1.0
    if not math.isfinite(value) or value <= 0:  # nan / inf would fail later, inside timedelta
        raise ParallelConfigError(f"{source}={raw!r}: give the timeout as a positive number of "
                                  "minutes, e.g. 30")
    return value


def init_distributed(timeout: float | None = None):
    """Start torch.distributed on this backend's collective library (gloo, nccl or hccl).

    Reads the launcher's RANK / WORLD_SIZE / LOCAL_RANK (torchrun); a plain ``python`` run becomes a
    world of one. On an accelerator each process takes device LOCAL_RANK. ``timeout`` is in minutes
    (default: $ADAPTER_DIST_TIMEOUT_MINUTES, else 30). Returns the backend.

    On cuda the group is bound to its device (``device_id``): NCCL then connects here, once, and
    megatron's model-parallel groups are split from that communicator, where without it each group's
    communicator is made lazily inside its first collective (start-up measured in tens of seconds on a
    GPU). HCCL is left unbound: torch_npu's group has no eager connect to take it."""
    b = backend.current()
    if torch.distributed.is_initialized():
        return b
    minutes = timeout_minutes(timeout)
    if b.is_accelerator:
        device.set_device(int(os.environ.get("LOCAL_RANK", "0")) % device.device_count())
    options = dict(backend=b.dist_backend, timeout=datetime.timedelta(minutes=minutes))
    if b.name == "cuda":
        options["device_id"] = device.torch_device()
    if "WORLD_SIZE" in os.environ:
        torch.distributed.init_process_group(**options)
    else:
        torch.distributed.init_process_group(store=torch.distributed.HashStore(), rank=0,
                                             world_size=1, **options)
    return b


def _default_hccl_buffer_mb() -> int:
    raw = os.environ.get("HCCL_BUFFSIZE", str(DEFAULT_HCCL_BUFFER_MB))
    if not raw.isdigit() or int(raw) < 1:
        raise ParallelConfigError(f"HCCL_BUFFSIZE={raw!r}: give the buffer size in MB, e.g. 200")
    return int(raw)


def hccl_group_options(pg_name: str, nccl_comm_cfgs: dict):
    """Stands in for megatron's get_nccl_options on NPU: HCCL options for the group ``pg_name``.

    Every group gets its name and a buffer size; per-group values come from the same YAML file megatron
    reads for NCCL (``nccl_communicator_config_path``), e.g. ``tp: {hccl_buffer_size: 400}``."""
    from torch_npu._C._distributed_c10d import ProcessGroupHCCL

    settings = dict(nccl_comm_cfgs.get(pg_name) or {})
    unknown = set(settings) - set(_HCCL_KEYS) - set(_NCCL_ONLY_KEYS)
    if unknown:
        raise ParallelConfigError(
            f"communicator config for group {pg_name!r} has unknown keys {sorted(unknown)}; HCCL "
            f"understands {list(_HCCL_KEYS)}")
    config = {key: settings[key] for key in _HCCL_KEYS if key in settings}
    config.setdefault("hccl_buffer_size", _default_hccl_buffer_mb())
    config["group_name"] = pg_name[:32]
    options = ProcessGroupHCCL.Options()
    options.hccl_config = config  # hccl_config cannot be updated in place: assign a whole dict
    return options

"""Parallel start-up and process groups, the mechanism: distributed start-up on the adapter's backend (process
group, parallel sizes, HCCL group options). The registry entries that install it into megatron are
``patches/parallel.py``."""

from __future__ import annotations

import dataclasses
import datetime
import functools
import inspect
import math
import os

import torch

from adapter import backend, device, elastic

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


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What of a model a parallel layout must divide, as plain numbers (the core knows no model config):
    ``ModelConfig.shape()`` gives it; any field left None is not checked."""

    num_layers: int | None = None
    num_attention_heads: int | None = None
    num_query_groups: int | None = None
    vocab_size: int | None = None
    ffn_hidden_size: int | None = None  # the dense MLPs' (None where every layer is MoE)
    num_experts: int | None = None
    expert_ffn_hidden_size: int | None = None
    moe_shared_expert_intermediate_size: int | None = None
    expert_bias: bool = False
    seq_length: int | None = None
    # a hybrid model's Gated DeltaNet (key heads, value heads): split over TP, then each rank's over CP
    linear_attention_heads: tuple[int, int] | None = None


@dataclasses.dataclass(frozen=True)
class PipelineSplit:
    """An uneven split of the layers over the pipeline stages, Megatron-LM's way (TransformerConfig's
    ``num_layers_in_first_pipeline_stage`` / ``..._last_...``, or the embedding and the loss counted as one
    layer each on the first and last stage); the default is the even split."""

    first: int | None = None
    last: int | None = None
    embedding: bool = False
    loss: bool = False


def check_sizes(world_size: int | None, *, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
                etp: int | None = None, vpp: int | None = None, gtp: int = 1, egtp: int = 1,
                model: ModelShape | None = None, sequence_parallel: bool = False,
                split: PipelineSplit = PipelineSplit()) -> int | None:
    """The parallel-layout rules, in one place: refuse a layout that cannot work, with the bad value and the
    fix in the message; return the data-parallel size (None without a world size).

    The arguments, ``initialize_model_parallel`` (through the registry), the memory plan and the model
    configs all call this. ``world_size`` None checks the layout against the model alone (conversion).
    ``gtp`` / ``egtp`` are megatron-core 0.19's weight-rematerialising tensor-parallel axes
    (``gtp_remat_size``, ``expert_gtp_remat_size``), which take ranks of their own on the dense and the
    expert grid."""
    for name, value in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp),
                        ("context_parallel_size", cp), ("expert_model_parallel_size", ep),
                        ("gtp_remat_size", gtp), ("expert_gtp_remat_size", egtp)):
        _positive(name, value)
    etp = tp if etp is None else _positive("expert_tensor_parallel_size", etp)
    if vpp is not None and _positive("virtual_pipeline_model_parallel_size", vpp) and pp < 2:
        raise ParallelConfigError(f"virtual pipeline size {vpp} needs pipeline_model_parallel_size > 1 (got {pp}). "
                                  "Drop the virtual pipeline size or use a pipeline.")
    if model is not None:
        _check_model(model, tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp, pipeline_split=split)
        _check_linear_attention(model.linear_attention_heads, tp=tp, cp=cp)
        _check_sequence(model.seq_length, tp=tp, cp=cp, sequence_parallel=sequence_parallel)
    if world_size is None:
        return None
    _positive("world_size", world_size)
    dense = [("tensor", tp), ("pipeline", pp), ("context", cp)] + [("gtp_remat", gtp)] * (gtp > 1)
    _divides_world(world_size, dense, "Launch a multiple of {n} processes, or change the sizes.")
    expert = [("expert tensor", etp), ("expert", ep), ("pipeline", pp)] + [("expert gtp_remat", egtp)] * (egtp > 1)
    _divides_world(world_size, expert, "Change expert_model_parallel_size or expert_tensor_parallel_size"
                   + (" or expert_gtp_remat_size." if egtp > 1 else "."))
    return world_size // math.prod(size for _, size in dense)


def _divides_world(world_size: int, axes: list, fix: str) -> None:
    size = math.prod(n for _, n in axes)
    if world_size % size:
        raise ParallelConfigError(f"world size {world_size} is not divisible by "
                                  + " x ".join(f"{name} ({n})" for name, n in axes)
                                  + f" parallel = {size}. " + fix.format(n=size))


def _check_model(model: ModelShape, *, tp: int, pp: int, vpp: int | None, ep: int, etp: int,
                 pipeline_split: PipelineSplit = PipelineSplit()) -> None:
    """Heads, query groups, vocabulary and MLP widths split over (expert) tensor parallelism, layers over
    pipeline stages, experts over expert parallelism."""
    split = [("num_attention_heads", tp, "tensor"), ("num_query_groups", tp, "tensor"),
             ("vocab_size", tp, "tensor"), ("ffn_hidden_size", tp, "tensor"),
             ("expert_ffn_hidden_size", etp, "expert tensor"), ("moe_shared_expert_intermediate_size", tp, "tensor"),
             ("num_experts", ep, "expert")]
    for name, size, kind in split:
        value = getattr(model, name)
        if value is not None and value % size:
            article = "an" if kind.startswith("e") else "a"
            raise ParallelConfigError(f"{kind} parallel size {size} does not divide {name}={value}: use {article} "
                                      f"{kind} parallel size that divides {value}")
    stages = pp * (vpp or 1)
    if model.num_layers is not None and pipeline_split != PipelineSplit():
        _check_uneven_split(model.num_layers, pp, vpp, pipeline_split)
    elif model.num_layers is not None and model.num_layers % stages:
        raise ParallelConfigError(f"{model.num_layers} layers cannot be split evenly over pipeline ({pp}) x virtual "
                                  f"pipeline ({vpp or 1}) = {stages} stages: choose sizes whose product divides "
                                  f"{model.num_layers}")
    if model.num_experts is None and ep > 1:
        raise ParallelConfigError(f"expert parallel size {ep} for a dense model: set num_experts, or use 1")
    if model.num_experts is not None and model.expert_bias and etp > 1:
        raise ParallelConfigError(f"expert tensor parallel size {etp} with add_bias_linear=True: megatron supports "
                                  "expert biases only at expert tensor parallel size 1")


def _check_uneven_split(num_layers: int, pp: int, vpp: int | None, split: PipelineSplit) -> None:
    """Megatron's rules for an uneven pipeline split (TransformerConfig's ``__post_init__``), refused before
    the model is built: the given first / last stage sizes leave the middle stages an even share, each stage's
    layers divide into the virtual stages; or, with the embedding / loss counted as layers, those divide."""
    vpp = vpp or 1
    if split.first is not None or split.last is not None:
        if split.embedding or split.loss:
            raise ParallelConfigError("the first / last pipeline stage's layer counts and the embedding or loss "
                                      "counted in the split go apart: give one of them")
        ends = [n for n in (split.first, split.last) if n is not None]
        middle, stages = num_layers - sum(ends), pp - len(ends)
        if any(n < 1 for n in ends) or middle < 0 or bool(middle) != bool(stages) or (stages and middle % stages) \
                or any(n % vpp for n in ends) or (stages and (middle // stages) % vpp):
            raise ParallelConfigError(
                f"{num_layers} layers over pipeline {pp} x virtual pipeline {vpp} with first stage {split.first} and "
                f"last stage {split.last} layers: the {middle} other layers must split evenly over the {stages} "
                f"middle stages, and every stage's layers over the {vpp} virtual stages: change the stage sizes")
        return
    counted = num_layers + split.embedding + split.loss
    if counted % pp or (counted // pp) % vpp:
        raise ParallelConfigError(f"{num_layers} layers + {int(split.embedding) + int(split.loss)} (embedding / loss) "
                                  f"= {counted} cannot be split evenly over pipeline ({pp}) x virtual pipeline ({vpp}) "
                                  "stages: choose sizes whose product divides it")


def _check_linear_attention(heads: tuple[int, int] | None, *, tp: int, cp: int) -> None:
    """Gated DeltaNet's key and value heads over TP, then each TP rank's over CP: megatron-core's context
    parallelism for it is an all-to-all from sequence chunks to heads."""
    if heads is None:
        return
    bad = [f"{name}={value}" for name, value in zip(("linear_num_key_heads", "linear_num_value_heads"), heads)
           if value % (tp * cp)]
    if bad:
        sizes = f"tensor parallel size {tp}" + (f" x context parallel size {cp}" if cp > 1 else "")
        raise ParallelConfigError(f"{sizes} does not divide Gated DeltaNet's {', '.join(bad)}: choose sizes whose "
                                  "product divides them")


def _check_sequence(seq_length: int | None, *, tp: int, cp: int, sequence_parallel: bool) -> None:
    """The sequence over context parallelism (megatron's load-balanced split: 2 x CP chunks, rank r holding
    chunks r and 2CP-1-r), then each CP rank's tokens over TP where sequence parallelism splits them."""
    if seq_length is None:
        return
    if cp > 1 and seq_length % (2 * cp):
        raise ParallelConfigError(f"seq_length={seq_length} is not divisible by 2 x context parallel size {cp} "
                                  f"= {2 * cp} (megatron's load-balanced split cuts the sequence into 2 x CP "
                                  "chunks): change the sequence length or the context parallel size")
    per_rank = seq_length // cp
    if sequence_parallel and per_rank % tp:
        raise ParallelConfigError(f"sequence parallelism splits each CP rank's {per_rank} tokens over TP {tp}, "
                                  "which does not divide them: change the sequence length, TP or CP")


def checked_initialize_model_parallel(initialize_model_parallel):
    """Registry wrapper: check megatron's sizes against the world before any group is created."""

    signature = inspect.signature(initialize_model_parallel)

    @functools.wraps(initialize_model_parallel)
    def initialize(*args, **kwargs):
        if not torch.distributed.is_initialized():
            raise ParallelConfigError(
                "initialize_model_parallel needs torch.distributed first: call "
                "adapter.init_distributed() (or torch.distributed.init_process_group) before it.")
        given = signature.bind(*args, **kwargs)
        given.apply_defaults()
        check_sizes(_world_size(given.arguments), **{
            ours: given.arguments[name] for name, ours in _MEGATRON_SIZE_ARGUMENTS.items()
            if name in given.arguments})
        return initialize_model_parallel(*args, **kwargs)

    return initialize


# initialize_model_parallel's size arguments (by name, as each release spells them) -> check_sizes'
_MEGATRON_SIZE_ARGUMENTS = {
    "tensor_model_parallel_size": "tp", "pipeline_model_parallel_size": "pp",
    "virtual_pipeline_model_parallel_size": "vpp", "context_parallel_size": "cp",
    "expert_model_parallel_size": "ep", "expert_tensor_parallel_size": "etp",
    "gtp_remat_size": "gtp", "expert_gtp_remat_size": "egtp"}  # the last two from 0.19


def _world_size(arguments: dict) -> int:
    """The world megatron lays the groups over: 0.19's ``local_world_size`` where given."""
    local = arguments.get("local_world_size")
    return torch.distributed.get_world_size() if local is None else local


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
    GPU). HCCL is left unbound: torch_npu's group has no eager connect to take it. Under torchrun the groups
    meet under a store prefix of this generation's own, so a restart never reads a dead one's addresses
    (``adapter.elastic``)."""
    b = backend.current()
    if torch.distributed.is_initialized():
        return b
    minutes = timeout_minutes(timeout)
    if b.is_accelerator:
        device.set_device(int(os.environ.get("LOCAL_RANK", "0")) % device.device_count())
    options = dict(backend=b.dist_backend, timeout=datetime.timedelta(minutes=minutes))
    if b.name == "cuda":
        options["device_id"] = device.torch_device()
    if elastic.shares_agent_store():  # torchrun's store outlives a restart: this generation's own prefix
        store, rank, world_size = elastic.generation_store(options["timeout"])
        torch.distributed.init_process_group(store=store, rank=rank, world_size=world_size, **options)
    elif "WORLD_SIZE" in os.environ:
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

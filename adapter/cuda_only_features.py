"""CUDA-only features, the mechanism: megatron features that need CUDA itself, as data (what configures
each, where its CUDA code lives, why no other device can run it), and the check that refuses them.

Off CUDA each is refused where it is configured (the registry entries, ``patches/cuda_only_features.py``:
the config dataclasses' ``__post_init__``, Megatron-LM's ``validate_args``, the constructors of the
classes that are the feature), with one line naming the setting, instead of a "Torch not compiled with
CUDA enabled" from deep inside megatron. The audit ``tests/cuda_inventory.py`` gives the CUDA sites under
``code`` the verdict ``refused``.
"""

from __future__ import annotations

import dataclasses

from adapter import backend


class RefusedSetting(ValueError):
    """A setting this backend cannot run, said in one line for the job (``adapter.run``) before any model
    is built; also the base of ``adapter.input_refusals.InputRefused`` (bad arguments or data)."""


class CudaOnlyFeatureError(RefusedSetting):
    """A feature that needs CUDA was configured on another backend."""


@dataclasses.dataclass(frozen=True)
class Feature:
    name: str
    settings: tuple[str, ...]  # config fields / Megatron-LM args that turn it on (truthy, and not "none")
    code: tuple[str, ...]  # "module" or "module:Qualname" prefixes holding its CUDA sites
    why: str
    constructors: tuple[str, ...] = ()  # registry targets (Class.__init__) that are the feature itself
    values: tuple = ()  # where given: only these values of the setting turn it on
    unless: tuple[str, ...] = ()  # settings that, when on, make the feature run without CUDA
    library: str = ""  # the CUDA library it needs, where it is one (not CUDA itself, nor torch)
    instead: str = "turn it off to run here"  # what runs on every backend instead


FEATURES = (
    Feature("CUDA graphs", ("enable_cuda_graph", "external_cuda_graph", "cuda_graph_impl"),
            ("megatron.core.transformer.cuda_graphs", "megatron.core.full_cuda_graph",
             "megatron.core.tensor_parallel.random:CudaRNGStatesTracker.__init__",
             "megatron.training.initialize:_initialize_distributed torch.cuda.set_stream"),
            "graphs are captured and replayed by the CUDA driver",
            instead="leave --cuda-graph-impl at none (the default; the same steps run eagerly)"),
    Feature("fp8 / fp4 training", ("fp8", "fp4"), (),
            "the low-precision GEMMs are Transformer Engine's CUDA kernels", library="Transformer Engine",
            instead="train in bf16 instead (--bf16)"),
    Feature("TP communication overlap", ("tp_comm_overlap",), (),
            "the tensor-parallel GEMMs are overlapped with their collectives through Transformer Engine's "
            "userbuffers", library="Transformer Engine",
            instead="drop --tp-comm-overlap (the tensor-parallel collectives then run between the GEMMs)"),
    Feature("the flex token dispatcher", ("moe_token_dispatcher_type",), (),
            "its all-to-all is DeepEP's or HybridEP's CUDA kernels over NVLink and RDMA",
            values=("flex",), library="DeepEP or HybridEP",
            instead="use --moe-token-dispatcher-type alltoall (or allgather), which runs on every backend"),
    Feature("batch-invariant kernels", ("batch_invariant_mode",),
            ("megatron.core.transformer.custom_layers.batch_invariant_kernels",),
            "the kernels are triton programs sized by the GPU's streaming multiprocessors"),
    Feature("Megatron-FSDP's standalone fully_shard API", (),
            ("megatron.core.distributed.fsdp.src.megatron_fsdp.fully_shard:fully_shard_model",
             "megatron.core.distributed.fsdp.src.megatron_fsdp.utils:_get_cuda_rng_state",
             "megatron.core.distributed.fsdp.src.megatron_fsdp.utils:initialize_rng_tracker",
             "megatron.core.distributed.fsdp.src.megatron_fsdp.experimental.parameter_group"),
            "it builds its device mesh with init_device_mesh('cuda') and its RNG tracker and experimental "
            "parameter groups on CUDA graphs and CUDA memory pools; megatron's FullyShardedDataParallel "
            "(--use-megatron-fsdp) runs on every backend",
            ("megatron.core.distributed.fsdp.src.megatron_fsdp.fully_shard:fully_shard_model",)),
    Feature("NCCL user buffers", ("nccl_ub",), ("megatron.core.nccl_allocator",),
            "buffers are registered with NCCL from CUDA memory pools", library="NCCL",
            instead="drop --use-nccl-ub (the collectives then use the backend's own buffers)"),
    Feature("symmetric-memory all-reduce", ("symmetric_ar_type",),
            ("megatron.core.utils:GlobalSymmetricMemoryBuffer",  # 0.16
             "megatron.core.inference.symmetric_memory:SymmetricMemoryBuffer"),  # 0.17+
            "torch's symmetric memory needs NVLink-connected CUDA devices",
            instead="drop --symmetric-ar-type (all-reduces then run through the backend's collective library)"),
    Feature("inference-optimized layers", ("use_inference_optimized_layers",),
            ("megatron.core.tensor_parallel.inference_layers",  # 0.16; from 0.17 it holds no CUDA site itself:
             "megatron.core.inference.communication.torch_symm_triton",  # its NVLS collectives (0.17+)
             "megatron.core.inference.moe"),  # and its MoE kernels (0.18+)
            "they are Transformer Engine layers whose collectives and MoE kernels are triton programs on CUDA "
            "symmetric memory, sized by the GPU's multiprocessor count"),
    Feature("optimizer CUDA graphs", ("optimizer_cuda_graph",),
            ("megatron.core.optimizer.optimizer_cuda_graph",),  # 0.17+
            "the optimizer step is captured and replayed as a CUDA graph"),
    Feature("the dynamic inference engine", (),
            ("megatron.core.inference.contexts.dynamic_context",
             "megatron.core.inference.contexts.fused_kv_append_kernel",
             "megatron.core.inference.engines.dynamic_engine",
             "megatron.core.inference.unified_memory",
             "megatron.core.inference.utils:device_memory_summary",  # torch_memory_saver's log line (0.17+)
             "megatron.training.training:pretrain torch.cuda.use_mem_pool"),
            "its KV cache lives in CUDA memory pools and is filled by triton kernels",
            ("megatron.core.inference.contexts.dynamic_context:DynamicInferenceContext.__init__",
             "megatron.core.inference.engines.dynamic_engine:DynamicInferenceEngine.__init__")),
    Feature("NVSHMEM weight refit", ("refit_method",), ("megatron.core.resharding.nvshmem_copy_service",),
            "NVSHMEM copies between CUDA devices; --refit-method gloo works on every backend",
            values=("nvshmem",)),
    Feature("NIXL weight refit", ("refit_method",),
            ("megatron.core.resharding.copy_services.nixl_copy_service",),  # 0.19+
            "NIXL registers the weights as CUDA memory with UCX's cuda transports; --refit-method gloo works "
            "on every backend", values=("nixl",)),
    Feature("CUDA memory history", ("record_memory_history",),
            ("megatron.training.training:training_log torch.cuda.memory._snapshot",
             "megatron.training.utils.utils:start_memory_history_recording"),  # 0.19+
            "the snapshot is the CUDA caching allocator's"),
    Feature("nsys profiling", ("profile",),
            ("megatron.training.training:post_training_step_callbacks torch.cuda.cudart",
             "megatron.training.training:post_training_step_callbacks torch.cuda.check_error",
             "megatron.training.training:train torch.cuda.cudart",
             "megatron.training.training:train torch.cuda.check_error"),
            "it starts the CUDA profiler; --use-pytorch-profiler works on every backend",
            unless=("use_pytorch_profiler",)),
)


def configured(feature: Feature, source) -> str | None:
    """The setting of ``source`` (a config or Megatron-LM's args) that turns ``feature`` on
    (``fp8='hybrid'``), or None."""
    found = turned_on(feature, source)
    return None if found is None else f"{found[0]}={found[1]!r}"


def turned_on(feature: Feature, source) -> tuple[str, object] | None:
    """(setting, value) of ``source`` that turns ``feature`` on, or None."""
    if any(getattr(source, setting, None) for setting in feature.unless):
        return None
    for setting in feature.settings:
        value = getattr(source, setting, None)
        if (value in feature.values) if feature.values else (value and value != "none"):
            return setting, value
    return None


# Megatron-LM's flags whose name is not the setting's (``--fp8-format`` sets ``args.fp8``)
FLAGS = {"fp8": "--fp8-format", "fp4": "--fp4-format", "nccl_ub": "--use-nccl-ub"}


def as_flag(setting: str, value) -> str:
    """A setting as Megatron-LM's command line spells it: ``--fp8-format hybrid``; a switch
    (``tp_comm_overlap=True``) as ``--tp-comm-overlap``."""
    flag = FLAGS.get(setting, "--" + setting.replace("_", "-"))
    return flag if value is True else f"{flag} {value}"


def refusal(feature: Feature, what: str) -> CudaOnlyFeatureError:
    """The one line: ``what`` (the setting or flag), the feature, the CUDA library it needs and what runs here
    instead."""
    library = f", with {feature.library}" if feature.library else ""
    installed = f" with {feature.library} installed" if feature.library else ""
    return CudaOnlyFeatureError(f"{what}: {feature.name} runs only on CUDA{library} ({feature.why}); this process "
                                f"runs on the {backend.current().name} backend: {feature.instead}, or run on "
                                f"CUDA{installed}")


def check(source, flags: bool = False) -> None:
    """Refuse the first CUDA-only feature ``source`` turns on (off CUDA); ``flags``: name the setting as
    Megatron-LM's command line does (``source`` is its arguments)."""
    if backend.current().name == "cuda":
        return
    for feature in FEATURES:
        found = turned_on(feature, source)
        if found is not None:
            raise refusal(feature, as_flag(*found) if flags else configured(feature, source))


def owner(module: str, qualname: str, spelling: str) -> Feature | None:
    """The feature whose code holds this site, or None."""
    found = owning_code(module, qualname, spelling)
    return found[0] if found else None


def owning_code(module: str, qualname: str, spelling: str) -> tuple[Feature, str] | None:
    """(feature, the entry of its ``code`` that holds this site), or None: the inventory names the entry,
    so that an entry matching nothing on a release that has its code is found stale."""
    for feature in FEATURES:
        for code in feature.code:
            where, _, only = code.partition(" ")
            prefix, _, qualname_prefix = where.partition(":")
            if not (module == prefix or module.startswith(prefix + ".")):
                continue
            if qualname_prefix and not (qualname == qualname_prefix or qualname.startswith(qualname_prefix + ".")):
                continue
            if only and spelling != only:
                continue
            return feature, code
    return None

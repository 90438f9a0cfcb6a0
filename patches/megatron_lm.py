"""Megatron-LM's own training loop (megatron.training, megatron.legacy; tag core_v0.16.1) through the adapter.

Its CUDA spellings are routed with megatron-core's, by the one rule (patches/cuda_routing.py). What its
unchanged pretrain_gpt.py needs beyond that, each found as a blocker on a CPU run (TP2 x PP2 and DP2 with
the distributed optimizer, save and resume); most apply on cpu and npu
only, a few (apex missing, the fp32 optimizer-state load) on every backend. The megatron-core wheel has no
megatron.training: these targets stay pending until a Megatron-LM checkout is importable (the environment
report shows them as skipped). ``python -m adapter.run`` is the launcher (README).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import importlib.util
import os

import torch

from adapter import backend, elastic, stand_ins

OFF_CUDA = ("cpu", "npu")
_T = "megatron.training."


def signal_handler_device(local_rank=None):
    """dist_signal_handler all-gathers the exit-signal flag on cuda for nccl and on cpu for gloo, and leaves
    the device unset for any other backend (hccl). Here: cpu for gloo groups, else this backend's device."""
    from adapter import device

    if torch.distributed.get_backend() == "gloo" or not backend.current().is_accelerator:
        return torch.device("cpu")
    return device.torch_device(local_rank)


def _print_rank_0(args, message: str) -> None:
    if getattr(args, "rank", 0) == 0:
        print(f"[adapter] {message}", flush=True)


def backend_collectives(validate_args):
    """--distributed-backend offers nccl and gloo and defaults to nccl: init_process_group must get this
    backend's collective library instead (gloo on cpu; hccl on npu, which argparse would refuse)."""

    @functools.wraps(validate_args)
    def validate(args, *rest, **kwargs):
        wanted = backend.current().dist_backend
        if args.distributed_backend != wanted:
            _print_rank_0(args, f"--distributed-backend {args.distributed_backend} -> {wanted} on the "
                                f"{backend.current().name} backend")
            args.distributed_backend = wanted
        return validate_args(args, *rest, **kwargs)

    return validate


def one_connection_off_cuda(validate_args):
    """With TP or CP > 1 before Blackwell, validate_args asserts CUDA_DEVICE_MAX_CONNECTIONS=1 (ordering of
    CUDA kernel queues for overlapped communication). Off CUDA the variable means nothing, so it is set
    when unset, which is what the assertion asks for; except with Megatron-FSDP or torch FSDP2, which assert
    the opposite (and with TP only warn)."""

    @functools.wraps(validate_args)
    def validate(*args, **kwargs):
        namespace = args[0] if args else kwargs.get("args")
        if not (getattr(namespace, "use_megatron_fsdp", False) or getattr(namespace, "use_torch_fsdp2", False)):
            os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
        return validate_args(*args, **kwargs)

    return validate


def no_gradient_accumulation_fusion_without_apex(validate_args):
    """Gradient-accumulation fusion is on by default, and ColumnParallelLinear raises at model build when
    apex's fused_weight_gradient_mlp_cuda is missing (every CPU and NPU machine). Turned off there, with one
    line saying so, as --no-gradient-accumulation-fusion would: the gradients are the same, accumulated by
    torch. On CUDA it stays on: patches/grad_accumulation.py's stand-in serves where apex is missing."""

    @functools.wraps(validate_args)
    def validate(args, *rest, **kwargs):
        if (args.gradient_accumulation_fusion and backend.current().name != "cuda"
                and importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is None):
            _print_rank_0(args, "gradient accumulation fusion needs apex's fused_weight_gradient_mlp_cuda, "
                                "which is not installed: running as with --no-gradient-accumulation-fusion")
            args.gradient_accumulation_fusion = False
        return validate_args(args, *rest, **kwargs)

    return validate


def rng_untouched_by_data_iterators(build):
    """Each DataLoader iterator draws its workers' base seed from the CPU default generator. On cpu that
    generator is also the device RNG dropout draws from, and a resumed run builds its iterators after
    --load restored the RNG, so its dropout stream would be shifted against the uninterrupted run's. Building
    the iterators leaves the generator as it was (on CUDA the draw never touches dropout's generator)."""

    @functools.wraps(build)
    def build_iterators(*args, **kwargs):
        state = torch.get_rng_state()
        try:
            return build(*args, **kwargs)
        finally:
            torch.set_rng_state(state)

    return build_iterators


def no_fused_kernels(args):
    """megatron.legacy.fused_kernels.load runs ``$CUDA_HOME/bin/nvcc -V`` to pick CUDA arch flags; there is
    no CUDA toolkit to ask, and nothing to build, off CUDA."""


def compile_helpers_unless_shipped(compile_helpers):
    """compile_helpers runs ``make`` in megatron/core/datasets; the megatron-core wheel ships the compiled
    helpers_cpp and no Makefile. Compiled only where they are missing (a source tree)."""

    @functools.wraps(compile_helpers)
    def compile_if_missing():
        if importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is None:
            compile_helpers()

    return compile_if_missing


def no_device_arch():
    """get_device_arch_version reads cuda:0's compute capability (8 Ampere, 9 Hopper, 10 Blackwell); off
    CUDA there is none: 0, i.e. none of the behaviour keyed to an NVIDIA architecture."""
    return 0


def state_copy_without_autograd(set_states):
    """_set_main_param_and_optimizer_states copies checkpoint tensors into the main params in place. With
    fp32 parameters a main param shard is a view of a leaf parameter that requires grad, so the copy
    raises unless autograd is off, and Megatron-LM's load_checkpoint does not turn it off (with bf16/fp16
    the main params are separate fp32 copies, which is why mixed-precision CUDA runs never see it)."""

    @functools.wraps(set_states)
    def set_main_param_and_optimizer_states(*args, **kwargs):
        with torch.no_grad():
            return set_states(*args, **kwargs)

    return set_main_param_and_optimizer_states


# ---------------------------------------------------------------- stand-in (adapter.stand_ins)
BATCH_INVARIANT_KERNELS = "megatron.core.transformer.custom_layers.batch_invariant_kernels"


def _refuse_batch_invariant_mode(module) -> None:
    """The four names the module exports: batch-invariant mode is never on, and turning it on (only
    --batch-invariant-mode does) fails saying why."""

    def refuse(*args, **kwargs):
        raise RuntimeError(f"--batch-invariant-mode needs triton (its kernels are triton kernels), which is "
                           f"not installed on this {backend.current().name} machine")

    def set_batch_invariant_mode(enabled: bool = True):
        if enabled:
            refuse()
        return contextlib.nullcontext()

    module.enable_batch_invariant_mode = refuse
    module.disable_batch_invariant_mode = lambda: None
    module.is_batch_invariant_mode_enabled = lambda: False
    module.set_batch_invariant_mode = set_batch_invariant_mode


def class_types_only(register_hooks):
    """0.18+'s activation logging hooks every module of ``LINEAR_TYPES``, which lists Transformer Engine's
    layers; without TE megatron's extension module leaves MagicMock placeholders for them, and
    ``isinstance(module, (..., placeholder))`` raises TypeError. The placeholders name no layer a model can
    hold, so they are dropped: the hooks go on the layers that exist."""

    @functools.wraps(register_hooks)
    def register(model, module_types, hook_factory, **kwargs):
        return register_hooks(model, tuple(t for t in module_types if isinstance(t, type)), hook_factory, **kwargs)

    return register


def generation_store_under_torchrun(initialize_distributed):
    """megatron.training's ``_initialize_distributed`` given a store of this generation's own where torchrun's
    agent hosts the store (``adapter.elastic``), as ``adapter.init_distributed`` does for the flow. Left to
    itself it meets in the agent's store, which keeps a dead generation's addresses across a restart: a rank
    of the restart that reads those before its peers overwrite them fails in gloo's ``Connection refused``
    (3 restarts in 5 in tests/test_megatron_lm.py). A store the caller gives (Megatron-LM's in-process
    restart) and ``--fake-process-group`` stay as they are."""

    @functools.wraps(initialize_distributed)
    def initialize(get_embedding_ranks, get_position_embedding_ranks, store=None, *args, **kwargs):
        from megatron.training.global_vars import get_args

        megatron_args = get_args()
        if (store is None and elastic.shares_agent_store() and not torch.distributed.is_initialized()
                and not getattr(megatron_args, "fake_process_group", False)):
            timeout = datetime.timedelta(minutes=megatron_args.distributed_timeout_minutes)
            store, _, _ = elastic.generation_store(timeout)
        return initialize_distributed(get_embedding_ranks, get_position_embedding_ranks, store, *args, **kwargs)

    return initialize


def register(registry, versions: str) -> None:
    registry.wrap(f"{_T}arguments:validate_args", backend_collectives, versions=versions, backends=OFF_CUDA,
                  reason="--distributed-backend defaults to nccl and cannot say hccl")
    registry.wrap(f"{_T}arguments:validate_args", one_connection_off_cuda, versions=versions,
                  backends=OFF_CUDA, reason="TP/CP > 1 asserts CUDA_DEVICE_MAX_CONNECTIONS=1, meaningless off CUDA")
    registry.wrap(f"{_T}arguments:validate_args", no_gradient_accumulation_fusion_without_apex,
                  versions=versions, reason="gradient-accumulation fusion defaults on and needs apex's CUDA extension")
    registry.wrap(f"{_T}initialize:_initialize_distributed", generation_store_under_torchrun, versions=versions,
                  reason="torchrun's store keeps a dead generation's addresses: a restart meets under its own prefix")
    registry.wrap(f"{_T}training:build_train_valid_test_data_iterators", rng_untouched_by_data_iterators,
                  versions=versions, backends=("cpu",),
                  reason="DataLoader seeding draws from the CPU generator, which is dropout's on cpu (resume)")
    registry.replace("megatron.legacy.fused_kernels:load", no_fused_kernels, versions=versions,
                     backends=OFF_CUDA, reason="runs $CUDA_HOME/bin/nvcc -V; nothing to build off CUDA")
    registry.wrap("megatron.core.datasets.utils:compile_helpers", compile_helpers_unless_shipped,
                  versions=versions, reason="runs make; the megatron-core wheel ships helpers_cpp and no Makefile")
    registry.replace(f"{_T}dist_signal_handler:get_device", signal_handler_device, versions=versions,
                     backends=OFF_CUDA, reason="picks cuda for nccl, cpu for gloo, nothing for hccl")
    registry.replace(f"{_T}utils:get_device_arch_version", no_device_arch, versions=versions,
                     backends=OFF_CUDA, reason="reads the compute capability of cuda:0")
    registry.wrap(f"{_T}activation_logging:_register_hooks", class_types_only, versions=versions, optional=True,
                  reason="0.18+: without TE, LINEAR_TYPES holds TE placeholders that isinstance refuses")
    registry.wrap("megatron.core.optimizer.distrib_optimizer:DistributedOptimizer._set_main_param_and_optimizer_states",
                  state_copy_without_autograd, versions=versions,
                  reason="fp32 params: loading copies into views of leaf params, which needs autograd off")
    stand_ins.install(stand_ins.StandIn(
        BATCH_INVARIANT_KERNELS, requires="triton", versions=versions, fill=_refuse_batch_invariant_mode,
        checked=registry.checked,
        reason="imports triton at the top, and megatron.training.initialize imports it: no megatron.training "
               "without triton"))

"""Megatron-LM's two offloading features in this flow, with Megatron-LM's flags, defaults and meanings.

- Optimizer offloading (``--optimizer-cpu-offload``): megatron's ``HybridDeviceOptimizer`` steps
  ``--optimizer-offload-fraction`` of the parameters (default 1.0, Megatron-LM's) with their Adam state in
  host memory and the rest on the device. These are ``OptimizerConfig`` fields of the same names; as in
  Megatron-LM it needs ``--use-precision-aware-optimizer`` (the distributed optimizer's path it reuses),
  hence ``--use-distributed-optimizer`` and ``--optimizer adam``. Megatron-LM's precision-aware dtypes
  (``--main-params-dtype`` and the like) only choose TE FusedAdam's storage; the hybrid optimizer keeps fp32
  state whatever they say, so this flow does not take them.
- Fine-grained activation offloading (``--fine-grained-activation-offloading``): megatron's offload manager
  saves the inputs of ``--offload-modules`` to host memory after their forward and copies them back before
  their backward. ``TransformerConfig`` fields of the same names; megatron's schedules reset the manager
  every iteration, so the loop adds nothing but what Megatron-LM's ``pretrain`` does first: bind the
  process's CPUs to the GPU's NUMA node (``start``; off CUDA the registry answers it, patches/activation_offload.py).

Settings that cannot run are refused in ``check`` before any model is built, one line each: megatron's own
checks and the adapter's (patches/host_offload.py: no offloading on the cpu backend but under the host
stand-in, no float32 parameters) are asked of a config built from these arguments, so the line is theirs.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

OPTIMIZER_FIELDS = ("optimizer_cpu_offload", "optimizer_offload_fraction", "use_precision_aware_optimizer",
                    "use_torch_optimizer_for_cpu_offload", "overlap_cpu_optimizer_d2h_h2d", "pin_cpu_grads",
                    "pin_cpu_params")
ACTIVATION_FIELDS = ("fine_grained_activation_offloading", "offload_modules", "min_offloaded_tensor_size",
                     "activation_offload_fraction", "delta_offload_bytes_across_pp_ranks")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("offloading")
    g.add_argument("--optimizer-cpu-offload", action="store_true",
                   help="step part of the optimizer (megatron's HybridDeviceOptimizer) with its state in host memory")
    g.add_argument("--optimizer-offload-fraction", type=float, default=1.0,
                   help="with --optimizer-cpu-offload: the share of the optimizer state kept in host memory")
    g.add_argument("--use-precision-aware-optimizer", action="store_true",
                   help="the distributed optimizer's precision-aware path, which --optimizer-cpu-offload runs on "
                        "(alone it needs Transformer Engine's FusedAdam)")
    g.add_argument("--use-torch-optimizer-for-cpu-offload", action="store_true",
                   help="the host optimizer's class on the device part too (megatron-core 0.19 picks both "
                        "classes by --optimizer whatever this says)")
    g.add_argument("--overlap-cpu-optimizer-d2h-h2d", action="store_true",
                   help="overlap the host step with the gradient and parameter copies")
    g.add_argument("--no-pin-cpu-grads", action="store_false", dest="pin_cpu_grads",
                   help="host copies of the gradients in pageable memory")
    g.add_argument("--no-pin-cpu-params", action="store_false", dest="pin_cpu_params",
                   help="host copies of the parameters in pageable memory")
    g.add_argument("--fine-grained-activation-offloading", action="store_true",
                   help="save the inputs of --offload-modules to host memory until their backward")
    g.add_argument("--offload-modules", nargs="+", default=[],
                   help="attn_norm qkv_linear core_attn attn_proj mlp_norm (dense), expert_fc1 moe_act (MoE)")
    g.add_argument("--min-offloaded-tensor-size", type=int, default=1024 * 1024,
                   help="tensors with fewer elements stay on the device")
    g.add_argument("--activation-offload-fraction", type=float, default=1.0,
                   help="the share of eligible offload groups offloaded")
    g.add_argument("--delta-offload-bytes-across-pp-ranks", type=int, default=0,
                   help="the difference of offloaded bytes across pipeline stages, to balance their loads")


def optimizer_fields(args: argparse.Namespace) -> dict:
    """``OptimizerConfig``'s offloading fields; none unless asked for (as megatron's defaults)."""
    if not (args.optimizer_cpu_offload or args.use_precision_aware_optimizer):
        return {}
    return {name: getattr(args, name) for name in OPTIMIZER_FIELDS}


def transformer_fields(args: argparse.Namespace) -> dict:
    """``TransformerConfig``'s activation-offloading fields; none unless asked for (older megatron-cores lack
    them)."""
    if not args.fine_grained_activation_offloading:
        return {}
    return {name: getattr(args, name) for name in ACTIVATION_FIELDS}


def check(args: argparse.Namespace, error: type[Exception]) -> None:
    """Refuse with ``error`` (one line) what megatron or the adapter would refuse once the model is built."""
    if args.optimizer_cpu_offload:
        _require(args.use_precision_aware_optimizer, error,
                 "--optimizer-cpu-offload needs --use-precision-aware-optimizer (megatron's HybridDeviceOptimizer "
                 "runs on the distributed optimizer's precision-aware path), as Megatron-LM asks")
        _require(0 <= args.optimizer_offload_fraction <= 1, error,
                 f"--optimizer-offload-fraction {args.optimizer_offload_fraction}: a share, from 0 to 1")
    if optimizer_fields(args):
        _asked(_optimizer_config, args, error)
    if args.fine_grained_activation_offloading:
        _require(bool(args.offload_modules), error,
                 "--fine-grained-activation-offloading needs --offload-modules (e.g. core_attn attn_proj)")
        _asked(_transformer_config, args, error)
        _require(os.environ.get("NVTE_CPU_OFFLOAD_V1", "0") == "1" or not _te_offloads_weights(), error,
                 "--fine-grained-activation-offloading with Transformer Engine 2.10 or later: set "
                 "NVTE_CPU_OFFLOAD_V1=1 so that TE offloads no weights, as Megatron-LM asks")


def start(args: argparse.Namespace) -> None:
    """What Megatron-LM's ``pretrain`` does first for fine-grained offloading: the process's CPUs on the GPU's
    NUMA node, for the host copies (off CUDA the registry leaves the affinity as launched)."""
    if args.fine_grained_activation_offloading:
        from megatron.core.pipeline_parallel.utils import set_ideal_affinity_for_current_gpu

        set_ideal_affinity_for_current_gpu()


def _require(condition: bool, error: type[Exception], message: str) -> None:
    if not condition:
        raise error(message)


def _asked(build, args: argparse.Namespace, error: type[Exception]) -> None:
    """Build the config megatron will check, turning its refusal (an assertion, the registry's refused
    setting) into ``error`` with its text."""
    try:
        build(args)
    except (AssertionError, ValueError, RuntimeError) as exc:
        raise error(str(exc)) from None


def _optimizer_config(args: argparse.Namespace):
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(optimizer=args.optimizer, bf16=args.bf16, fp16=args.fp16, params_dtype=args.params_dtype,
                           use_distributed_optimizer=args.use_distributed_optimizer, **optimizer_fields(args))


def _transformer_config(args: argparse.Namespace):
    """A one-layer config with these offloading settings and the selective recompute's modules: megatron
    checks them together (no MoE activation offloaded inside a recomputed MoE layer)."""
    from megatron.core.transformer import TransformerConfig

    names = {field.name for field in dataclasses.fields(TransformerConfig)}
    missing = [name for name in ACTIVATION_FIELDS if name not in names]
    if missing:
        raise ValueError(f"--{missing[0].replace('_', '-')}: this megatron-core has no fine-grained activation "
                         "offloading; install megatron-core 0.19 or later")
    recompute = {}
    if args.recompute_granularity == "selective" and args.recompute_modules:
        recompute = {"recompute_granularity": "selective", "recompute_modules": args.recompute_modules}
    return TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=1, **recompute,
                             **transformer_fields(args))


def _te_offloads_weights() -> bool:
    """Whether Transformer Engine is here at 2.10 or later, whose offloading takes weights unless told."""
    from megatron.core.utils import is_te_min_version

    try:
        return is_te_min_version("2.10.0")
    except Exception:  # noqa: BLE001 - no TE (or no version to read): nothing of TE's offloads
        return False

"""Megatron-LM's recipes as written, off Transformer Engine and off CUDA (issue 43): what its ``validate_args``
asks that has an answer on every backend.

``--transformer-impl transformer_engine`` is Megatron-LM's default and what most recipes pass; without
Transformer Engine, pretrain_gpt's builders call ``get_gpt_layer_with_transformer_engine_spec``, whose
``TESpecProvider`` is None (``TypeError: 'NoneType' object is not callable`` on every rank). The local spec
is the same layer with the kernel provider's norm, core attention and grouped GEMM (patches/kernels.py), and
names its state-dict keys as TE's (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``), so
checkpoints load under either spelling. Setting ``args.transformer_impl`` before validation (rather than
wrapping the spec chooser) keeps everything downstream consistent: the config's ``transformer_impl``, the
builders' choice, the checks on TE-only features, and the checkpoint's recorded arguments.

``--moe-grouped-gemm`` asserts an NVIDIA compute capability >= 8 (CUTLASS's grouped GEMM). Off CUDA the
experts run the kernel provider's grouped GEMM (``npu_grouped_matmul``, torch's), which asks no capability:
the check is answered for them. It is the only use of the flag in ``validate_args``.

Whether TE is importable is the CUDA provider's answer (``cuda_provider.HAVE_TE``), the one the kernels
and the flow's kernel line use too.
"""

from __future__ import annotations

import functools

from adapter.kernels import cuda_provider

_T = "megatron.training."
OFF_CUDA = ("cpu", "npu")


def _say(args, message: str) -> None:
    """One line, from rank 0 only: validate_args runs on every rank."""
    if getattr(args, "rank", 0) == 0:
        print(f"[adapter] {message}", flush=True)


def local_spec_without_transformer_engine(validate_args):
    """``--transformer-impl transformer_engine`` without TE runs as ``local``: the adapter's layer spec."""

    @functools.wraps(validate_args)
    def validate(args, *rest, **kwargs):
        if args.transformer_impl == "transformer_engine" and not cuda_provider.HAVE_TE:
            from adapter import kernels

            _say(args, "--transformer-impl transformer_engine: Transformer Engine is not importable, so megatron's "
                       f"local spec runs, with the {kernels.current().NAME} kernel provider's norm, core attention "
                       "and grouped GEMM (as --transformer-impl local; checkpoints load under either)")
            args.transformer_impl = "local"
        return validate_args(args, *rest, **kwargs)

    return validate


def grouped_gemm_without_compute_capability(validate_args):
    """``--moe-grouped-gemm`` off CUDA: megatron's CUTLASS capability check is skipped (the flag is hidden
    from ``validate_args`` for the call and restored), the provider's grouped GEMM runs the experts."""

    @functools.wraps(validate_args)
    def validate(args, *rest, **kwargs):
        if not args.moe_grouped_gemm:
            return validate_args(args, *rest, **kwargs)
        from adapter import backend, kernels

        _say(args, f"--moe-grouped-gemm: the experts run the {kernels.current().NAME} kernel provider's grouped "
                   f"GEMM, which needs no NVIDIA compute capability (none on the {backend.current().name} backend)")
        return validated_with_flag_hidden(validate_args, args, "moe_grouped_gemm", *rest, **kwargs)

    return validate


def validated_with_flag_hidden(validate_args, args, flag: str, *rest, **kwargs):
    """``validate_args`` with the switch ``flag`` off for the call, then on again: for a check of
    Megatron-LM's that ties the feature to a CUDA library the adapter answers otherwise."""
    setattr(args, flag, False)
    try:
        return validate_args(args, *rest, **kwargs)
    finally:
        setattr(args, flag, True)


def register(registry, versions: str) -> None:
    registry.wrap(f"{_T}arguments:validate_args", local_spec_without_transformer_engine, versions=versions,
                  reason="--transformer-impl transformer_engine (the default) without TE: the local spec, "
                         "whose keys are TE's")
    registry.wrap(f"{_T}arguments:validate_args", grouped_gemm_without_compute_capability, versions=versions,
                  backends=OFF_CUDA, reason="--moe-grouped-gemm asserts cuda's compute capability >= 8; the "
                                            "provider's grouped GEMM asks none")

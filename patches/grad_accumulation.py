"""megatron's ``gradient_accumulation_fusion`` without apex, on CUDA.

With the flag, megatron's linear layers write each weight gradient straight into the float32 ``main_grad``
that DDP reduces (one GEMM accumulating into it), instead of a bf16 ``.grad`` that a hook then adds to
``main_grad``: a [out, in] bf16 tensor and an elementwise pass per weight per micro-batch saved. The GEMM
is apex's ``fused_weight_gradient_mlp_cuda``; megatron's tensor_parallel.layers imports it at the top and
refuses the flag at model build where that fails. Here its two functions are torch's, bound where the
import left the name unbound: ``addmm`` with ``out_dtype`` (float16/bfloat16 inputs, float32 accumulate and
output, one cuBLAS call as apex's), or a plain ``addmm_`` where the dtypes agree.

CUDA only: the layers' backward allocates its placeholder gradient with ``torch.cuda.current_device()``.
Megatron's deferred embedding wgrad (``defer_embedding_wgrad_compute``, pipeline parallel) imports the
module again itself and still needs apex.
"""

from __future__ import annotations

import types

import torch

_LAYERS = "megatron.core.tensor_parallel.layers"


def wgrad_gemm_accum_fp32(input, grad_output, main_grad):
    """``main_grad += grad_output^T @ input`` with float32 ``main_grad`` [out, in] from 2-D ``input``
    [tokens, in] and ``grad_output`` [tokens, out] of any float dtype, accumulated in float32."""
    grad_t = grad_output.t()
    if input.dtype == main_grad.dtype:
        main_grad.addmm_(grad_t, input)
    elif main_grad.is_cuda:
        addmm_into_fp32(main_grad, grad_t, input)
    else:  # torch has addmm's out_dtype on CUDA only; the CPU (tests) upcasts
        main_grad.addmm_(grad_t.to(main_grad.dtype), input.to(main_grad.dtype))


def addmm_into_fp32(main_grad, grad_t, input):
    """``main_grad += grad_t @ input`` in one GEMM from half-precision operands, accumulated and written in
    float32 (CUDA; the meta device checks the same call's shapes and dtypes)."""
    torch.addmm(main_grad, grad_t, input, out_dtype=main_grad.dtype, out=main_grad)


def wgrad_gemm_accum_fp16(input, grad_output, main_grad):
    """The same into a float16/bfloat16 ``main_grad`` (megatron calls it when the gradients are not kept
    in float32); accumulated by the GEMM in float32, as apex's."""
    main_grad.addmm_(grad_output.t().to(main_grad.dtype), input.to(main_grad.dtype))


STAND_IN = types.SimpleNamespace(wgrad_gemm_accum_fp32=wgrad_gemm_accum_fp32,
                                 wgrad_gemm_accum_fp16=wgrad_gemm_accum_fp16,
                                 __name__="fused_weight_gradient_mlp_cuda (adapter stand-in)")


def register(registry, versions: str) -> None:
    registry.bind(f"{_LAYERS}:fused_weight_gradient_mlp_cuda", STAND_IN, versions=versions, backends=("cuda",),
                  reason="gradient_accumulation_fusion's wgrad GEMM into main_grad on torch's addmm (no apex)")
    registry.replace(f"{_LAYERS}:_grad_accum_fusion_available", True, versions=versions, backends=("cuda",),
                     rebind_copies=False,
                     reason="the layers refuse gradient_accumulation_fusion without apex; torch's GEMM answers it")

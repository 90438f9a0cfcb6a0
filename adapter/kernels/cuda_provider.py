"""The ``cuda`` kernel provider: what is installed, else PyTorch's fused kernels.

- Transformer Engine installed: megatron's own ``TEDotProductAttention`` and ``TENorm``, and megatron's
  TE-backed RoPE and cross entropy stay as megatron wires them.
- flash-attn installed: ``flash_attn_func`` / ``flash_attn_varlen_func`` for CUDA half-precision tensors
  without an explicit mask (GQA, causal, sliding window and packed sequences natively).
- Otherwise ``scaled_dot_product_attention``, which picks its flash or memory-efficient kernel on CUDA
  and takes GQA unexpanded (``enable_gqa``).
- RMSNorm, RoPE and SwiGLU without Transformer Engine: ``ADAPTER_CUDA_FUSED=liger|compile|eager``
  (``fused_elementwise``) picks Liger-Kernel's Triton kernels, torch.compile'd regions or plain torch.
- ``cross_entropy_loss_fusion`` without Transformer Engine: the adapter's one-function cross entropy
  (adapter/kernels/cross_entropy.py: no float32 copy of the logits kept apart from the softmax it saves,
  no host sync, no boolean-mask writes), where megatron's unfused one syncs the host on its masks.
- Gated DeltaNet: flash-linear-attention's kernels where installed (megatron's own binding), else the
  torch provider's (adapter/kernels/gated_delta.py).

It also runs on CPU tensors (SDPA's CPU kernels), which is how its argument building is tested here.
"""

from __future__ import annotations

import importlib
import importlib.util
import os

import torch

from adapter import backend as _backend
from adapter.kernels import KernelProviderUnavailable, UnsupportedKernelSetting, cross_entropy, torch_provider
from adapter.kernels.provider import complete

NAME = "cuda"

HAVE_TE = importlib.util.find_spec("transformer_engine") is not None
HAVE_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None
HAVE_SOFTMAX_EXTENSION = importlib.util.find_spec("scaled_masked_softmax_cuda") is not None
HAVE_GROUPED_GEMM = importlib.util.find_spec("grouped_gemm") is not None
HAVE_LIGER = importlib.util.find_spec("liger_kernel") is not None
HAVE_FLA = importlib.util.find_spec("fla") is not None
FUSED_ENV = "ADAPTER_CUDA_FUSED"
FUSED_CHOICES = ("liger", "compile", "eager")


def _te_module(name: str):
    return getattr(importlib.import_module("megatron.core.extensions.transformer_engine"), name)


def installed_core_attention():
    return _te_module("TEDotProductAttention") if HAVE_TE else None


def installed_norm():
    return _te_module("TENorm") if HAVE_TE else None


def installed_grouped_linear():
    """Transformer Engine's grouped linear layers, as megatron's TE spec pairs them with TEGroupedMLP."""
    if not HAVE_TE:
        return None
    return _te_module("TEColumnParallelGroupedLinear"), _te_module("TERowParallelGroupedLinear")


def grouped_mm(x, weight, tokens_per_expert):
    """Without Transformer Engine: the ``grouped_gemm`` package's CUTLASS kernel when installed (what
    megatron's legacy GroupedMLP calls), else torch's grouped GEMM for CUDA bfloat16 (rows of whole
    16-byte multiples), else one GEMM per expert. ``weight`` is the experts' stacked [E, out, in] parameter,
    read in place; ``tokens_per_expert`` a list of ints or an int tensor."""
    torch_provider.check_expert_counts(tokens_per_expert, weight)
    if x.is_cuda and HAVE_GROUPED_GEMM:
        gmm = importlib.import_module("grouped_gemm").ops.gmm
        return gmm(x, weight, _host_counts(tokens_per_expert), trans_b=True)
    if x.is_cuda and x.dtype == weight.dtype == torch.bfloat16 and not (x.shape[-1] % 8 or weight.shape[1] % 8):
        return torch_grouped_mm(x, weight, tokens_per_expert)
    return torch_provider.grouped_mm(x, weight, tokens_per_expert)


def torch_grouped_mm(x, weight, tokens_per_expert):
    """torch's grouped GEMM over the stacked weight, forward and backward: what ``grouped_mm`` runs for
    CUDA bfloat16. torch has a CPU kernel for it too, which is how the CPU suite checks this call."""
    return torch.nn.functional.grouped_mm(x.contiguous(), weight.transpose(1, 2),
                                          offs=_group_ends(tokens_per_expert, x.device))


def _host_counts(tokens_per_expert) -> torch.Tensor:
    """grouped_gemm's ``batch_sizes``: int64 counts on the host, where its kernel reads them."""
    if torch.is_tensor(tokens_per_expert):
        return tokens_per_expert.to("cpu", torch.int64)
    return torch.tensor(tokens_per_expert, dtype=torch.int64)


def _group_ends(tokens_per_expert, device: torch.device) -> torch.Tensor:
    """torch's grouped GEMM ``offs``: int32 cumulative row ends on the device, summed there. Counts
    given as a list go up to a GPU from pinned memory without blocking the host, as one copy of E ints."""
    if torch.is_tensor(tokens_per_expert):
        counts = tokens_per_expert.to(device, non_blocking=True)
    else:
        pinned = device.type == "cuda"  # pinning needs a GPU; CPU counts are where they are used
        counts = torch.tensor(tokens_per_expert, dtype=torch.int32, pin_memory=pinned).to(device, non_blocking=True)
    return counts.cumsum(0, dtype=torch.int32)


# moe_permute_fusion without Transformer Engine (with it, megatron binds TE's fused permutation itself)
moe_permute = torch_provider.moe_permute


def _flash_attn():
    return importlib.import_module("flash_attn")


def _flash_window(window, causal) -> tuple[int, int]:
    if window is None:
        return (-1, -1)
    left, right = window
    return (left, 0 if causal else right)


def _use_flash_attn(q, v, mask) -> bool:
    """flash-attn 2 takes one head size for q, k and v; a separate value head size (multi-latent attention)
    goes to SDPA, which takes it."""
    return (HAVE_FLASH_ATTN and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and mask is None
            and v.shape[-1] == q.shape[-1])


def attention(q, k, v, *, scale, causal, mask, window, dropout_p, cu_seqlens_q=None, cu_seqlens_kv=None):
    if q.shape[-2] % k.shape[-2]:
        raise UnsupportedKernelSetting(
            f"{q.shape[-2]} query heads over {k.shape[-2]} key/value heads: the query heads must be a "
            "multiple of the key/value groups")
    if _use_flash_attn(q, v, mask):
        flash = _flash_attn()
        if cu_seqlens_q is not None:
            out = flash.flash_attn_varlen_func(
                q, k, v, cu_seqlens_q, cu_seqlens_kv,
                int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()),
                int((cu_seqlens_kv[1:] - cu_seqlens_kv[:-1]).max()),
                dropout_p=dropout_p, softmax_scale=scale, causal=causal,
                window_size=_flash_window(window, causal))
            return out.reshape(out.shape[0], -1)
        sq, b = q.shape[:2]
        out = flash.flash_attn_func(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                    dropout_p=dropout_p, softmax_scale=scale, causal=causal,
                                    window_size=_flash_window(window, causal))
        return out.transpose(0, 1).reshape(sq, b, -1)
    if cu_seqlens_q is None:
        return torch_provider.sdpa_attention(q, k, v, scale, causal, mask, window, dropout_p)
    return torch_provider.per_sequence(torch_provider.sdpa_attention, q, k, v, cu_seqlens_q, cu_seqlens_kv,
                                       scale, causal, window, dropout_p)


def _sdpa_flash_with_lse(q) -> bool:
    """PyTorch's own flash-attention kernel (SDPA's), which hands back the rows' log-sum-exp, takes fp16 /
    bf16 CUDA tensors with a head size that is a multiple of 8, at most 256."""
    d = q.shape[-1]
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and d % 8 == 0 and d <= 256


def attention_with_lse(q, k, v, *, scale, causal):
    """Ring attention's block (the contract of ``torch_provider.attention_with_lse``) on SDPA's flash kernel
    where it runs, else the torch provider's. ``saved`` is what the kernel's forward hands back for its
    backward besides out and lse: its cumulative lengths (undefined without packing, None in Python), the
    lengths, and its RNG state; their form differs between torch releases, so they are passed on as they
    came, as torch's own ring attention does. With Transformer Engine installed megatron's own TE attention
    does context parallelism and this is not used."""
    if not _sdpa_flash_with_lse(q):
        return torch_provider.attention_with_lse(q, k, v, scale=scale, causal=causal)
    k, v = torch_provider.grouped_kv(k, v, q.shape[1])
    out, lse, *saved = torch.ops.aten._scaled_dot_product_flash_attention(
        q.contiguous(), k.contiguous(), v.contiguous(), 0.0, causal, scale=scale)[:8]
    return out, lse, tuple(saved)


def attention_grad_from_lse(dout, q, k, v, out, lse, *, scale, causal, saved=None):
    """The block's gradients from the rows' global out and lse (``torch_provider.attention_grad_from_lse``)
    on the flash kernel's backward, which rebuilds the softmax as exp(scores - lse), fed the block
    forward's own ``saved`` (cum_seq_q/k, max_q/k, RNG seed and offset)."""
    if not _sdpa_flash_with_lse(q):
        return torch_provider.attention_grad_from_lse(dout, q, k, v, out, lse, scale=scale, causal=causal)
    if saved is None:
        raise UnsupportedKernelSetting("the flash backward needs its forward's saved state: pass attention_with_lse's "
                                       "third result as saved=")
    groups = k.shape[1]
    k, v = torch_provider.grouped_kv(k, v, q.shape[1])
    cum_seq_q, cum_seq_k, max_q, max_k, seed, offset = saved
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout.to(q.dtype).contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out.to(q.dtype).contiguous(),
        lse.float().contiguous(), cum_seq_q, cum_seq_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale)
    return dq, torch_provider.summed_over_groups(dk, groups), torch_provider.summed_over_groups(dv, groups)


def _no_softmax_extension(self, mask, b, np, sq, sk) -> bool:
    """Without apex's scaled_masked_softmax_cuda extension megatron's availability check would import it
    and fail; use the torch softmax instead."""
    return False


def fused_elementwise(requested: str | None, have_liger: bool, on_cuda: bool = True) -> tuple[str, str]:
    """Which kernels RMSNorm, RoPE and SwiGLU get without Transformer Engine, and why: ``requested``
    (``$ADAPTER_CUDA_FUSED``) when given, else Liger-Kernel where it is installed (one Triton kernel per
    op, forward and backward, no compile step at start), else torch.compile'd regions (the same fusion,
    compiled at the first step). ``eager`` is plain torch, for measuring the other two against, and what
    runs unasked off the cuda backend (this provider's CPU tests: no compile there for kernels meant for
    a GPU)."""
    requested = (requested or "").strip().lower()
    if requested and requested not in FUSED_CHOICES:
        raise KernelProviderUnavailable(f"{FUSED_ENV}={requested!r}: use one of {', '.join(FUSED_CHOICES)}")
    if requested == "liger" and not have_liger:
        raise KernelProviderUnavailable(f"{FUSED_ENV}=liger: Liger-Kernel is not installed "
                                        "(pip install liger-kernel, or the adapter's [cuda] extra)")
    if requested:
        return requested, f"{FUSED_ENV}={requested}"
    if not on_cuda:
        return "eager", f"not on the cuda backend ({FUSED_ENV} unset)"
    if have_liger:
        return "liger", f"Liger-Kernel is installed ({FUSED_ENV} unset)"
    return "compile", f"Liger-Kernel is not installed: torch.compile'd regions ({FUSED_ENV} unset)"


def _liger_rms_norm(x, weight, eps):
    """Liger's RMSNorm in the 'llama' casting (the inverse RMS in float32, as megatron's and HF's), its
    input gradient into a buffer of its own (``in_place=False``: megatron's residual keeps the incoming
    gradient)."""
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    return LigerRMSNormFunction.apply(x, weight, eps, 0.0, "llama", False)


def _liger_swiglu(input, bias, fp8_input_store=False, cpu_offload_input=False):
    """megatron's ``bias_swiglu_impl`` (bias-free, as Qwen's MLP) on Liger's gate-up SwiGLU, which reads the
    fc1 output [..., 2 * ffn] in place; a bias, fp8 input store or CPU offload go to megatron's own.

    Liger's function computes on a 2-D view [rows, 2 * ffn] and hands back a gradient of that shape, which
    autograd refuses for a 3-D input (liger-kernel 0.8.5): it gets the 2-D view, as megatron's own
    ``bias_swiglu_impl`` gives its kernel, and megatron gets its [s, b, ffn] back (views, no copies)."""
    if bias is not None or fp8_input_store or cpu_offload_input:
        from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

        return bias_swiglu_impl(input, bias, fp8_input_store, cpu_offload_input)
    from liger_kernel.ops.swiglu import LigerFusedGateUpSiLUMulFunction

    rows = LigerFusedGateUpSiLUMulFunction.apply(input.reshape(-1, input.shape[-1]))
    return rows.view(*input.shape[:-1], rows.shape[-1])


def _elementwise_kernels(choice: str) -> tuple:
    """(rms_norm, rope, bias_swiglu) for ``choice``. Liger's RoPE takes q and k together in HF's layout,
    not megatron's one [s, b, h, d] tensor at a time, so RoPE is compiled under ``liger`` too. SwiGLU is
    megatron's own under ``compile`` and ``eager``: it is already torch.compile'd (megatron's jit_fuser)."""
    if choice == "eager":
        return torch_provider._eager_rms_norm, torch_provider.rope, None
    compiled_rope = torch_provider.rope_over(torch.compile(torch_provider.rotated, dynamic=False), "compiled_rope")
    if choice == "liger":
        return _liger_rms_norm, compiled_rope, _liger_swiglu
    return torch.compile(torch_provider._eager_rms_norm, dynamic=False), compiled_rope, None


def gated_delta_kernels(fla_runs: bool) -> tuple:
    """(chunk_gated_delta_rule, causal_conv1d, l2norm) for megatron's GatedDeltaNet: None each where
    flash-linear-attention runs, which megatron binds itself (its Triton kernels take CUDA tensors: on the cuda
    backend only), else the torch provider's."""
    if fla_runs:
        return None, None, None
    return torch_provider.chunk_gated_delta_rule, torch_provider.causal_conv1d, torch_provider.l2norm


FUSED, FUSED_WHY = fused_elementwise(os.environ.get(FUSED_ENV), HAVE_LIGER, _backend.current().name == "cuda")
_rms_norm, _rope, _swiglu = _elementwise_kernels(FUSED)

# With the extension, megatron's own availability check and fused softmax stay.
softmax_fusable = None if HAVE_SOFTMAX_EXTENSION else _no_softmax_extension
rms_norm = _rms_norm
layer_norm = torch_provider.layer_norm
# megatron's own scaled masked softmax (apex's kernel) stays in place; with Transformer Engine, so do its
# RoPE and cross entropy. Without TE, megatron has no fused RoPE and refuses apply_rope_fusion (its default
# in Megatron-LM's arguments); this provider's then answers it.
bias_swiglu = None if HAVE_TE else _swiglu
rope = None if HAVE_TE else _rope
rope_thd = None if HAVE_TE else torch_provider.rope_thd
vocab_parallel_cross_entropy = None if HAVE_TE else cross_entropy.vocab_parallel_cross_entropy
chunk_gated_delta_rule, causal_conv1d, l2norm = gated_delta_kernels(HAVE_FLA and _backend.current().name == "cuda")

complete(globals())  # the base's defaults for the rest, and the norm class CudaNorm

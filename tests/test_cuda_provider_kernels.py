"""The cuda provider's kernels on the CPU, each ``ADAPTER_CUDA_FUSED`` choice (``eager``, ``compile``,
``liger``) through the provider's own entry points, at the shapes megatron hands them, forward and backward,
against float64 references written here from the formulas (GPU issue 34, item 1).

The provider is loaded afresh per choice (the choice is read at its import, as on a GPU). Liger's Triton
kernels run under Triton's interpreter (tests/triton_interpreter.py), in float32: the interpreter gets
bfloat16 products wrong. Shapes: [s, b, h] activations with sequence parallelism off, and [s / 2, b, h],
the slice a rank of two sees with it on; [s, b, 2 * ffn] for the fc1 output SwiGLU reads; experts with
uneven and empty row groups. What no CPU can run is listed in docs/CI.md.
"""

from __future__ import annotations

import contextlib
import importlib.util
import types

import pytest
import torch

from adapter.kernels import cuda_provider
from patches import grad_accumulation, torch_optimizers
from tests.kernel_reference import attention_config, forward_backward, randn
from tests.triton_interpreter import compiler_semantics, interpreting, liger_unavailable

SEQ, BATCH, HIDDEN, FFN = 16, 2, 64, 96
# sequence parallelism off: the whole sequence; on (TP 2): the half one rank holds
SEQUENCE = {"sp-off": SEQ, "sp-on": SEQ // 2}
TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=4e-2, rtol=4e-2)}


def _fresh_provider(choice: str) -> types.ModuleType:
    spec = importlib.util.find_spec("adapter.kernels.cuda_provider")
    module = importlib.util.module_from_spec(spec)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(cuda_provider.FUSED_ENV, choice)
        spec.loader.exec_module(module)
    assert module.FUSED == choice
    return module


@pytest.fixture(scope="module", params=["eager", "compile", "liger"])
def kernels(request):
    """The cuda provider with ``ADAPTER_CUDA_FUSED`` = the param, its kernels run on the GPU where there is
    one (``on_gpu``); without one, Liger's run interpreted on CPU tensors."""
    choice, on_gpu = request.param, torch.cuda.is_available()
    if choice == "liger" and liger_unavailable():
        pytest.skip(liger_unavailable())
    if choice == "liger" and not (on_gpu or interpreting()):
        pytest.skip("Triton was imported without TRITON_INTERPRET=1 and there is no GPU to compile for")
    interpreted = choice == "liger" and interpreting()
    with compiler_semantics() if interpreted else contextlib.nullcontext():
        yield types.SimpleNamespace(**vars(_fresh_provider(choice)), on_gpu=on_gpu, interpreted=interpreted)


def _device(kernels) -> str:
    return "cuda" if kernels.on_gpu else "cpu"


def _dtype_runs(kernels, dtype) -> None:
    if kernels.interpreted and dtype != torch.float32:
        pytest.skip("Triton's interpreter gets bfloat16 products wrong: Liger's kernels are checked interpreted "
                    "in float32 (on a GPU in both)")


def _run(fn, inputs: list, device: str = "cpu") -> list:
    """``forward_backward`` of fn on ``device`` (every input a leaf there), handed back on the CPU."""
    results = forward_backward(fn, [t.detach().to(device).requires_grad_(True) for t in inputs])
    return [None if t is None else t.cpu() for t in results]


def _close(got: list, want: list, dtype) -> None:
    assert [tuple(t.shape) for t in got] == [tuple(t.shape) for t in want]
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, **TOLERANCE[dtype])


def _reference(fn, inputs: list) -> list:
    return _run(fn, [t.double() for t in inputs])


# ------------------------------------------------------------------------------------------- norms
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sp", list(SEQUENCE))
@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
def test_the_providers_norm_module(kernels, normalization, sp, dtype):
    _dtype_runs(kernels, dtype)
    config = attention_config(dtype=dtype, normalization=normalization, sequence_parallel=sp == "sp-on",
                              tensor_model_parallel_size=2 if sp == "sp-on" else 1)
    norm = kernels.Norm(config, hidden_size=HIDDEN, eps=1e-6).to(_device(kernels))
    x = randn(SEQUENCE[sp], BATCH, HIDDEN, dtype=dtype, seed=1) * 2.0
    weight = (randn(HIDDEN, seed=2) * 0.1 + 1).to(dtype)
    bias = randn(HIDDEN, dtype=dtype, seed=3) * 0.1
    with torch.no_grad():
        norm.weight.copy_(weight)
        if norm.bias is not None:
            norm.bias.copy_(bias)

    def ours(x):
        return norm(x)

    got = _run(ours, [x], device=_device(kernels)) + [p.grad.cpu() for p in norm.parameters()]

    def reference(x, w, b):
        if normalization == "RMSNorm":
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
        centred = x - x.mean(-1, keepdim=True)
        return centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + 1e-6) * w + b

    want = _reference(reference, [x, weight, bias])
    _close(got, want[:len(got)], dtype)
    assert [p.sequence_parallel for p in norm.parameters()] == [sp == "sp-on"] * len(got[2:])


# ------------------------------------------------------------------------------------------- SwiGLU
def _swiglu_reference(y):
    gate, up = y.chunk(2, dim=-1)
    return gate * torch.sigmoid(gate) * up


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sp", list(SEQUENCE))
@pytest.mark.parametrize("rank", [3, 2], ids=["s-b-2f", "tokens-2f"])
def test_swiglu_takes_and_gives_megatrons_shapes(kernels, rank, sp, dtype):
    """megatron's MLP hands its fused SwiGLU the fc1 output [s, b, 2 * ffn]; the MoE experts [tokens, 2f]."""
    _dtype_runs(kernels, dtype)
    swiglu = kernels.bias_swiglu
    if swiglu is None:  # compile / eager: megatron's own torch.compile'd SwiGLU runs
        from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl as swiglu
    shape = (SEQUENCE[sp], BATCH, 2 * FFN) if rank == 3 else (SEQUENCE[sp] * BATCH, 2 * FFN)
    y = randn(*shape, dtype=dtype, seed=4) * 2.0
    got = _run(lambda y: swiglu(y, None), [y], device=_device(kernels))
    _close(got, _reference(_swiglu_reference, [y]), dtype)


def test_swiglu_with_a_bias_goes_to_megatrons_own(kernels):
    y, bias = randn(SEQ, BATCH, 2 * FFN, seed=5), randn(2 * FFN, seed=6)
    swiglu = kernels.bias_swiglu
    if swiglu is None:
        from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl as swiglu
    want = _reference(lambda y, b: _swiglu_reference(y + b), [y, bias])
    _close(_run(swiglu, [y, bias], device=_device(kernels)), want, torch.float32)


# --------------------------------------------------------------------------------------------- RoPE
def _angles(seq: int, rot: int) -> torch.Tensor:
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
    freqs = torch.outer(torch.arange(seq, dtype=torch.float64), inv_freq)
    return freqs


def _rope_reference(t, freqs, interleaved: bool):
    """Each pair (x_i, x_j) of the rotated dims turned by its angle: pairs are (i, i + rot/2), or
    neighbours when interleaved; dims past rot pass through."""
    rot = 2 * freqs.shape[-1]
    x, rest = t[..., :rot], t[..., rot:]
    cos, sin = freqs.cos()[:, None, None, :], freqs.sin()[:, None, None, :]
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
        turned = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    else:
        a, b = x[..., :rot // 2], x[..., rot // 2:]
        turned = torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)
    return torch.cat((turned, rest), dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rot", [32, 16], ids=["full", "partial"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
def test_rope_on_megatrons_s_b_heads_d(kernels, interleaved, rot, dtype):
    _dtype_runs(kernels, dtype)
    half = _angles(SEQ, rot)
    layout = torch.stack((half, half), -1).flatten(-2) if interleaved else torch.cat((half, half), -1)
    # megatron's RotaryEmbedding output [s, 1, 1, rot]
    freqs = layout[:, None, None, :].float().to(_device(kernels))
    t = randn(SEQ, BATCH, 4, 32, dtype=dtype, seed=7)
    got = _run(lambda t: kernels.rope(t, freqs, interleaved=interleaved), [t], device=_device(kernels))
    _close(got, _reference(lambda t: _rope_reference(t, half, interleaved), [t]), dtype)


# ------------------------------------------------------------------------------------ cross entropy
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_fusion_on_s_b_vocab(dtype):
    """``cross_entropy_loss_fusion`` without Transformer Engine: the provider's one-function cross entropy
    on megatron's [s, b, vocab] logits (one tensor-parallel rank)."""
    logits, target = randn(SEQ, BATCH, 300, dtype=dtype, seed=8) * 3.0, torch.randint(0, 300, (SEQ, BATCH))
    got = _run(lambda x: cuda_provider.vocab_parallel_cross_entropy(x, target, None), [logits])
    want = _reference(lambda x: -x.log_softmax(-1).gather(-1, target.unsqueeze(-1)).squeeze(-1), [logits])
    _close(got, want, dtype)


# ----------------------------------------------------------------------------------------- attention
def _attention_reference(q, k, v, scale):
    """Causal softmax(q k^T) v with each query head reading its key/value group, [s, b, n, d] in."""
    s, heads = q.shape[0], q.shape[2]
    k, v = (t.repeat_interleave(heads // t.shape[2], dim=2) for t in (k, v))
    scores = torch.einsum("sbnd,tbnd->bnst", q, k) * scale
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bnst,tbnd->sbnd", scores.softmax(-1), v).flatten(2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packed", [False, True], ids=["s-b", "packed"])
def test_attention_through_sdpa(dtype, packed):
    """The SDPA path (no flash-attn): causal, 8 query heads over 2 key/value groups; packed sequences
    as megatron's thd layout [t, n, d] with cu_seqlens, each sequence attending to itself only."""
    q = randn(SEQ, BATCH, 8, 16, dtype=dtype, seed=9)
    k, v = randn(SEQ, BATCH, 2, 16, dtype=dtype, seed=10), randn(SEQ, BATCH, 2, 16, dtype=dtype, seed=11)
    if not packed:
        got = _run(lambda q, k, v: cuda_provider.attention(q, k, v, scale=0.25, causal=True, mask=None,
                                                           window=None, dropout_p=0.0), [q, k, v])
        _close(got, _reference(lambda q, k, v: _attention_reference(q, k, v, 0.25), [q, k, v]), dtype)
        return
    bounds = torch.tensor([0, 5, 16], dtype=torch.int32)
    q, k, v = (t[:, 0] for t in (q, k, v))

    def ours(q, k, v):
        return cuda_provider.attention(q, k, v, scale=0.25, causal=True, mask=None, window=None, dropout_p=0.0,
                                       cu_seqlens_q=bounds, cu_seqlens_kv=bounds)

    def reference(q, k, v):
        return torch.cat([_attention_reference(q[a:b, None], k[a:b, None], v[a:b, None], 0.25)[:, 0]
                          for a, b in ((0, 5), (5, 16))])

    _close(_run(ours, [q, k, v]), _reference(reference, [q, k, v]), dtype)


# ------------------------------------------------------------------------------------- grouped GEMM
SPLITS = [40, 0, 72, 17]  # uneven, one expert without tokens


def _experts_reference(x, weight):
    rows = torch.split(x, SPLITS)
    return torch.cat([r @ weight[i].T for i, r in enumerate(rows)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("counts", ["list", "tensor"])
@pytest.mark.parametrize("path", ["grouped_mm", "torch_grouped_mm"])
def test_the_experts_grouped_gemm(path, counts, dtype):
    """``grouped_mm`` as it runs on CPU tensors (one GEMM per expert), and ``torch_grouped_mm``, the call it
    makes for CUDA bfloat16 (torch's grouped GEMM, which has a CPU kernel too), on uneven splits."""
    x, weight = randn(sum(SPLITS), 48, dtype=dtype, seed=12), randn(4, 32, 48, dtype=dtype, seed=13) * 0.2
    tokens = SPLITS if counts == "list" else torch.tensor(SPLITS)
    got = _run(lambda x, w: getattr(cuda_provider, path)(x, w, tokens), [x, weight])
    _close(got, _reference(_experts_reference, [x, weight]), dtype)


# -------------------------------------------------------------------- gradient-accumulation fusion
def test_wgrad_fusion_on_cuda_takes_bf16_tokens_into_fp32_main_grad_on_the_meta_device():
    """The CUDA branch of ``gradient_accumulation_fusion``'s wgrad GEMM (torch's addmm with ``out_dtype``,
    CUDA-only) on meta tensors: megatron's [s * b, in] / [s * b, out] bf16 inputs into an fp32 [out, in]
    main_grad, shapes and dtypes as the kernel checks them."""
    tokens = torch.empty(SEQ * BATCH, HIDDEN, dtype=torch.bfloat16, device="meta")
    grad_output = torch.empty(SEQ * BATCH, FFN, dtype=torch.bfloat16, device="meta")
    main_grad = torch.empty(FFN, HIDDEN, dtype=torch.float32, device="meta")
    grad_accumulation.addmm_into_fp32(main_grad, grad_output.t(), tokens)
    assert (main_grad.shape, main_grad.dtype) == ((FFN, HIDDEN), torch.float32)
    with pytest.raises(RuntimeError, match="reduction dim"):
        grad_accumulation.addmm_into_fp32(main_grad, grad_output.t(), tokens.t())


# --------------------------------------------------------------------------------------- fused AdamW
def _adamw_reference(params, grads, lr, betas, eps, decay):
    """AdamW (Loshchilov & Hutter), float64, one update per gradient list."""
    params = [p.double() for p in params]
    m, v = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    for step, step_grads in enumerate(grads, start=1):
        for i, g in enumerate(step_grads):
            g = g.double()
            m[i] = betas[0] * m[i] + (1 - betas[0]) * g
            v[i] = betas[1] * v[i] + (1 - betas[1]) * g * g
            m_hat, v_hat = m[i] / (1 - betas[0] ** step), v[i] / (1 - betas[1] ** step)
            params[i] = params[i] * (1 - lr * decay) - lr * m_hat / (v_hat.sqrt() + eps)
    return params


def test_fused_adamw_steps_as_adamw():
    """The Adam megatron builds (decoupled weight decay), made fused by the adapter's wrapper, three steps
    on a [ffn, h] weight and an [h] norm weight."""
    params = [torch.nn.Parameter(randn(FFN, HIDDEN, seed=14)), torch.nn.Parameter(randn(HIDDEN, seed=15) + 1)]
    start = [p.detach().clone() for p in params]
    grads = [[randn(*p.shape, seed=20 + 2 * step + i) for i, p in enumerate(params)] for step in range(3)]
    build = torch_optimizers.fused_torch_adam(lambda: types.SimpleNamespace(optimizer=torch.optim.Adam(
        params, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, decoupled_weight_decay=True)))
    optimizer = build().optimizer
    assert optimizer.param_groups[0]["fused"] is True
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        optimizer.step()
    want = _adamw_reference(start, grads, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, decay=0.1)
    for got, expected in zip(params, want):
        torch.testing.assert_close(got.detach().double(), expected, atol=1e-6, rtol=1e-6)

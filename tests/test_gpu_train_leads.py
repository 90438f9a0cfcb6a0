"""The dense-flow leads for one GPU (GPU issue 26, item 3), as far as a CPU shows them: the weight-gradient
GEMM stand-in against a float64 reference, the cuda provider's fused-kernel switch, SDPA's layout choice,
torch's fused Adam on CUDA parameters and its per-parameter step, and the CUDA defaults of the fusion flags."""

from __future__ import annotations

import types

import pytest
import torch

from adapter.kernels import KernelProviderUnavailable, cuda_provider, torch_provider
from patches import grad_accumulation, torch_optimizers


def _wgrad_inputs(dtype):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(96, 24, generator=generator).to(dtype)
    dy = torch.randn(96, 40, generator=generator).to(dtype)
    main_grad = torch.randn(40, 24, generator=generator)
    return x, dy, main_grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wgrad_accumulates_into_fp32_main_grad(dtype):
    x, dy, main_grad = _wgrad_inputs(dtype)
    want = main_grad.double() + torch.einsum("to,ti->oi", dy.double(), x.double())
    grad_accumulation.wgrad_gemm_accum_fp32(x, dy, main_grad)
    assert main_grad.dtype == torch.float32
    torch.testing.assert_close(main_grad.double(), want, rtol=1e-5, atol=1e-4)


def test_wgrad_into_bf16_main_grad():
    x, dy, main_grad = _wgrad_inputs(torch.bfloat16)
    main_grad = main_grad.bfloat16()
    want = main_grad.double() + torch.einsum("to,ti->oi", dy.double(), x.double())
    grad_accumulation.wgrad_gemm_accum_fp16(x, dy, main_grad)
    torch.testing.assert_close(main_grad.double(), want, rtol=2e-2, atol=0.3)


@pytest.mark.cuda
def test_wgrad_on_cuda_takes_bf16_inputs_into_fp32():
    x, dy, main_grad = (t.cuda() for t in _wgrad_inputs(torch.bfloat16))
    want = main_grad.double() + torch.einsum("to,ti->oi", dy.double(), x.double())
    grad_accumulation.wgrad_gemm_accum_fp32(x, dy, main_grad)
    torch.testing.assert_close(main_grad.double(), want, rtol=1e-4, atol=1e-3)


def test_grad_accumulation_patches_are_cuda_only():
    seen = []
    registry = types.SimpleNamespace(bind=lambda target, value, **kw: seen.append((target, kw["backends"])),
                                     replace=lambda target, value, **kw: seen.append((target, kw["backends"])))
    grad_accumulation.register(registry, "==0.16.1")
    assert seen == [("megatron.core.tensor_parallel.layers:fused_weight_gradient_mlp_cuda", ("cuda",)),
                    ("megatron.core.tensor_parallel.layers:_grad_accum_fusion_available", ("cuda",))]


@pytest.mark.parametrize("requested, have_liger, on_cuda, want", [
    (None, True, True, "liger"), (None, False, True, "compile"), ("eager", True, True, "eager"),
    ("compile", True, True, "compile"), (" LIGER ", True, True, "liger"), (None, True, False, "eager"),
    ("compile", False, False, "compile")])
def test_fused_elementwise_choice(requested, have_liger, on_cuda, want):
    assert cuda_provider.fused_elementwise(requested, have_liger, on_cuda)[0] == want


@pytest.mark.parametrize("requested", ["liger", "triton"])
def test_fused_elementwise_refuses_what_cannot_run(requested):
    with pytest.raises(KernelProviderUnavailable, match="ADAPTER_CUDA_FUSED"):
        cuda_provider.fused_elementwise(requested, have_liger=False)


def _reference_rope(t, freqs):
    """RoPE as HF writes it: t * cos + rotate_half(t) * sin."""
    x1, x2 = t.chunk(2, dim=-1)
    return t * freqs.cos() + torch.cat((-x2, x1), dim=-1) * freqs.sin()


@pytest.mark.parametrize("choice", ["compile", "eager"])
def test_compiled_and_eager_kernels_agree_with_references(choice):
    rms_norm, rope, swiglu = cuda_provider._elementwise_kernels(choice)
    assert swiglu is None  # megatron's own (already compiled by its jit_fuser)
    generator = torch.Generator().manual_seed(1)
    x, weight = torch.randn(6, 2, 32, generator=generator), torch.rand(32, generator=generator) + 0.5
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight
    torch.testing.assert_close(rms_norm(x, weight, 1e-6), want)
    t, freqs = torch.randn(6, 2, 4, 16, generator=generator), torch.rand(6, 1, 1, 16, generator=generator) * 3
    torch.testing.assert_close(rope(t, freqs), _reference_rope(t, freqs))


@pytest.mark.parametrize("backend, setting, copies", [
    ("cpu", None, True), ("cuda", None, False), ("cuda", "1", True), ("cpu", "0", False)])
def test_sdpa_layout_copies_on_cpu_only_unless_told(backend, setting, copies):
    view = torch.randn(4, 2, 3, 8).permute(1, 2, 0, 3)
    laid_out = torch_provider.sdpa_layout(backend, setting)(view)
    assert laid_out.is_contiguous() is copies and torch.equal(laid_out, view)


def test_sdpa_over_views_equals_over_copies(monkeypatch):
    generator = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(16, 2, 4, 8, generator=generator) for _ in range(3))
    want = torch_provider.sdpa_attention(q, k, v, 0.3, True, None, None, 0.0)
    monkeypatch.setattr(torch_provider, "_sdpa_layout", torch_provider.sdpa_layout("cuda", None))
    torch.testing.assert_close(torch_provider.sdpa_attention(q, k, v, 0.3, True, None, None, 0.0), want)


def _built_adam(monkeypatch, fused_env):
    if fused_env is not None:
        monkeypatch.setenv(torch_optimizers.FUSED_ADAM_ENV, fused_env)
    params = [torch.nn.Parameter(torch.randn(3))]
    build = torch_optimizers.fused_torch_adam(lambda: types.SimpleNamespace(optimizer=torch.optim.Adam(params)))
    return build().optimizer


@pytest.mark.parametrize("fused_env, fused", [(None, True), ("0", False)])
def test_fused_adam_unless_turned_off(monkeypatch, fused_env, fused):
    assert bool(_built_adam(monkeypatch, fused_env).param_groups[0]["fused"]) is fused


def test_the_optimizer_wrappers_reach_the_torch_optimizer_of_a_skip_wrapping_pair(monkeypatch):
    """megatron 0.17+ returns ``(torch optimizer, init_state_fn)`` with ``skip_megatron_wrapping=True``
    (its layer-wise optimizer): fused Adam and the lr=None stand-in reach that optimizer too."""
    monkeypatch.delenv(torch_optimizers.FUSED_ADAM_ENV, raising=False)
    params = [torch.nn.Parameter(torch.randn(3))]
    pair = torch_optimizers.fused_torch_adam(lambda: (torch.optim.Adam(params), print))()
    assert pair[1] is print and pair[0].param_groups[0]["fused"] is True
    monkeypatch.setattr(torch_optimizers, "_uses_torch_optimizer", lambda: True)
    config = types.SimpleNamespace(lr=None)
    later = torch_optimizers.learning_rate_set_later(lambda config: (torch.optim.Adam(params, lr=config.lr), None))
    optimizer, _ = later(config)
    assert config.lr is None and optimizer.param_groups[0]["lr"] is None


def test_fused_adam_patch_covers_cuda():
    seen = {}
    registry = types.SimpleNamespace(wrap=lambda target, fn, **kw: seen.setdefault(fn.__name__, kw.get("backends", ())),
                                     replace=lambda *a, **kw: None, bind=lambda *a, **kw: None)
    torch_optimizers.register(registry, "==0.16.1")
    assert set(seen["fused_torch_adam"]) == {"cpu", "cuda"}


@pytest.mark.parametrize("on_device", [True, False])
def test_each_parameter_gets_its_own_float32_step(on_device):
    param, shared = torch.nn.Parameter(torch.zeros(2)), torch.tensor(5.0, dtype=torch.float64)
    step = torch_optimizers._own_step(shared, param, on_device)
    assert (step.item(), step.dtype, step.device) == (5.0, torch.float32, param.device)
    step += 1
    assert shared.item() == 5.0


def _validated(monkeypatch, backend: str, argv: list[str]):
    """``argv`` over qwen2.5-tiny as the flow parses and validates it (megatron.training's parser with the
    adapter's patches) at one rank on ``backend``; megatron's globals unset after."""
    from megatron.core import num_microbatches_calculator
    from megatron.training import global_vars

    import adapter
    from tests.test_flow_arguments import TINY, parse_as_the_flow

    monkeypatch.setattr(adapter, "current_backend", lambda: types.SimpleNamespace(name=backend))
    monkeypatch.setattr(adapter.backend, "current", lambda: adapter.backend.Backend(backend))
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # validate_args sets it off CUDA
    try:
        return parse_as_the_flow(monkeypatch, [*TINY, *argv], 1)[0]
    finally:
        global_vars.unset_global_variables()
        num_microbatches_calculator.unset_num_microbatches_calculator()


def _fusions(args) -> tuple[bool, bool]:
    return args.cross_entropy_loss_fusion, args.gradient_accumulation_fusion


@pytest.mark.parametrize("backend, fused", [("cpu", False), ("cuda", True)])
def test_gradient_accumulation_fusion_keeps_megatrons_default_on_cuda_only(monkeypatch, backend, fused):
    """On CUDA, Megatron-LM's default (on), which patches/grad_accumulation.py's stand-in serves without apex;
    elsewhere off, where megatron's layers would refuse it without apex. Cross-entropy fusion is Megatron-LM's
    default, off, on every backend unless given (bench/gpu_train.py gives it, as Megatron-LM's recipes do)."""
    assert _fusions(_validated(monkeypatch, backend, [])) == (False, fused)
    if fused:
        assert not _validated(monkeypatch, backend, ["--no-gradient-accumulation-fusion"]).gradient_accumulation_fusion


def test_fusion_flags_given(monkeypatch):
    """--cross-entropy-loss-fusion turns it on; --no-gradient-accumulation-fusion keeps it off."""
    assert _validated(monkeypatch, "cpu", ["--cross-entropy-loss-fusion"]).cross_entropy_loss_fusion is True
    assert _validated(monkeypatch, "cpu", ["--no-gradient-accumulation-fusion"]).gradient_accumulation_fusion is False


def test_cuda_provider_answers_cross_entropy_fusion_without_te():
    from adapter.kernels import cross_entropy

    want = None if cuda_provider.HAVE_TE else cross_entropy.vocab_parallel_cross_entropy
    assert cuda_provider.vocab_parallel_cross_entropy is want


def test_report_says_which_elementwise_kernels_run(monkeypatch):
    from adapter import kernels, report

    monkeypatch.setattr(kernels, "current", lambda: cuda_provider)
    section = report.kernel_section()
    assert section["kernel_provider"]["fused_elementwise"] == f"{cuda_provider.FUSED} ({cuda_provider.FUSED_WHY})"
    assert f"RMSNorm/RoPE/SwiGLU: {cuda_provider.FUSED}" in report.kernel_summary()

"""MoE on every backend (issue 15): megatron-core's own MoE code, after ``import adapter``, without
Transformer Engine."""

import pytest
import torch

import adapter  # noqa: F401 - before megatron
from adapter import registry


def _have_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(_have_transformer_engine(), reason="with Transformer Engine megatron binds te_general_gemm")
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_the_router_gating_gemm_runs_without_transformer_engine(with_bias):
    """megatron leaves ``te_general_gemm`` unbound without TE; bound to None, the gating GEMM is
    megatron's torch fallback: the same logits and gradients as a plain ``F.linear`` in fp32."""
    from megatron.core.transformer.moe.moe_utils import router_gating_linear

    assert registry.status("megatron.core.transformer.moe.moe_utils:te_general_gemm") == "applied"
    generator = torch.Generator().manual_seed(0)
    inp = torch.randn(2, 3, 8, generator=generator, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(4, 8, generator=generator, dtype=torch.bfloat16, requires_grad=True)
    bias = torch.randn(4, generator=generator, dtype=torch.bfloat16, requires_grad=True) if with_bias else None
    logits = router_gating_linear(inp, weight, bias, torch.float32)
    ref_inp, ref_weight = inp.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    ref_bias = bias.detach().float().requires_grad_() if with_bias else None
    want = torch.nn.functional.linear(ref_inp, ref_weight, ref_bias)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, want)
    grad = torch.randn(want.shape, generator=generator)
    logits.backward(grad)
    want.backward(grad)
    torch.testing.assert_close(inp.grad.float(), ref_inp.grad, atol=2e-2, rtol=2e-2)  # bf16 grads
    torch.testing.assert_close(weight.grad.float(), ref_weight.grad, atol=2e-2, rtol=2e-2)

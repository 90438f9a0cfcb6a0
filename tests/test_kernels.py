"""Every fused op x every kernel provider, forward and backward, against megatron's own local path.

The npu provider runs on CPU tensors against the torch_npu double (tests/doubles), so what is tested is
its dispatch and argument building; ``torch_npu.CALLS`` proves the torch_npu op really ran. The cuda
provider runs its PyTorch-SDPA path here (no GPU, no flash-attn, no Transformer Engine).
"""

from __future__ import annotations

import sys

import pytest
import torch
from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl
from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
from megatron.core.models.common.embeddings.rope_utils import (
    _apply_rotary_pos_emb_bshd,
    _apply_rotary_pos_emb_thd,
)
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.utils import attention_mask_func

from adapter import kernels
from tests.kernel_reference import (
    assert_all_close,
    attention_config,
    called,
    forward_backward,
    leaves,
    megatron_swiglu,
    one_rank_model_parallel,
    randn,
)

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def model_parallel():
    with one_rank_model_parallel():
        yield


# ---------------------------------------------------------------------------------------------- norms
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
def test_norm_matches_megatron_local_norm(provider, normalization, dtype):
    config = attention_config(dtype=dtype, normalization=normalization)
    ours = kernels.norm_module(provider)(config, hidden_size=128, eps=1e-5)
    reference = WrappedTorchNorm(config, hidden_size=128, eps=1e-5).to(dtype)
    with torch.no_grad():
        for param in (*ours.parameters(), *reference.parameters()):
            param.copy_(randn(*param.shape, seed=3) * 0.1 + 1)
    x = randn(6, 2, 128, dtype=dtype)
    got = forward_backward(ours, leaves(x)) + [p.grad for p in ours.parameters()]
    want = forward_backward(reference, leaves(x)) + [p.grad for p in reference.parameters()]
    assert_all_close(got, want, dtype)
    if normalization == "RMSNorm":
        called(provider, "npu_rms_norm")


def test_norm_marks_parameters_for_the_sequence_parallel_all_reduce():
    config = attention_config(normalization="LayerNorm", sequence_parallel=True,
                              tensor_model_parallel_size=2)
    norm = kernels.norm_module(kernels.select_provider("torch"))(config, hidden_size=128)
    assert [p.sequence_parallel for p in norm.parameters()] == [True, True]


def test_zero_centered_gamma_stores_gamma_minus_one():
    config = attention_config(normalization="RMSNorm", layernorm_zero_centered_gamma=True)
    norm = kernels.norm_module(kernels.select_provider("torch"))(config, hidden_size=128)
    assert torch.count_nonzero(norm.weight) == 0
    x = randn(4, 128)
    torch.testing.assert_close(norm(x), torch.nn.functional.rms_norm(x, (128,), eps=1e-5))


def test_unknown_normalization_is_refused_by_name():
    config = attention_config(normalization="L2Norm")
    with pytest.raises(kernels.UnsupportedKernelSetting, match="'L2Norm'.*RMSNorm"):
        kernels.norm_module(kernels.select_provider("torch"))(config, hidden_size=128)


# --------------------------------------------------------------------------------------------- SwiGLU
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_swiglu_matches_megatron_unfused_glu(provider, with_bias, dtype):
    swiglu = provider.bias_swiglu or bias_swiglu_impl
    x, bias = randn(8, 2, 64, dtype=dtype), randn(64, dtype=dtype, seed=1)
    inputs = leaves(x, bias) if with_bias else leaves(x) + [None]
    got = forward_backward(swiglu, inputs)
    ref_inputs = leaves(x, bias) if with_bias else leaves(x) + [None]
    want = forward_backward(megatron_swiglu, ref_inputs)
    assert_all_close(got, want, dtype)
    called(provider, "npu_swiglu")


# ----------------------------------------------------------------------------------------------- RoPE
def _angles(seq: int, rot: int, interleaved: bool) -> torch.Tensor:
    """Angles laid out as megatron's RotaryEmbedding lays them out, [s, 1, 1, rot]."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    freqs = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)
    if interleaved:
        emb = torch.stack((freqs, freqs), dim=-1).flatten(-2)
    else:
        emb = torch.cat((freqs, freqs), dim=-1)
    return emb[:, None, None, :]


def _needs_rope(provider):
    if provider.rope is None:
        pytest.skip("the cuda provider keeps megatron's RoPE (Transformer Engine's when installed)")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rot", [32, 16], ids=["full", "partial"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_rope_matches_megatron_unfused_rope(provider, interleaved, rot, dtype):
    _needs_rope(provider)
    t, freqs = randn(12, 2, 4, 32, dtype=dtype), _angles(12, rot, interleaved)
    got = forward_backward(lambda x: provider.rope(x, freqs, interleaved=interleaved), leaves(t))
    want = forward_backward(
        lambda x: _apply_rotary_pos_emb_bshd(x, freqs, rotary_interleaved=interleaved), leaves(t))
    assert_all_close(got, want, dtype)
    called(provider, "npu_rotary_mul")


def test_rope_reuses_angles_only_while_they_are_the_same():
    """The torch provider computes cos/sin once per angle tensor; a change of layout, dtype or of the
    angles themselves (in place) gives fresh ones."""
    provider = kernels.select_provider("torch")
    freqs = _angles(12, 32, False)

    def check(interleaved, dtype):
        t = randn(12, 2, 4, 32, dtype=dtype)
        got = provider.rope(t, freqs, interleaved=interleaved)
        assert got.dtype == dtype
        assert_all_close(got, _apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=interleaved), dtype)

    check(False, torch.float32)
    check(True, torch.float32)
    check(True, torch.bfloat16)
    freqs.mul_(2.0)
    check(True, torch.bfloat16)


class _OneRankGroup:
    def size(self):
        return 1

    def rank(self):
        return 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_rope_restarts_positions_per_sequence(provider, dtype):
    _needs_rope(provider)
    cu_seqlens = torch.tensor([0, 5, 12, 20], dtype=torch.int32)
    t, freqs = randn(20, 4, 32, dtype=dtype), _angles(16, 32, False)
    got = forward_backward(lambda x: provider.rope_thd(x, cu_seqlens, freqs), leaves(t))
    want = forward_backward(lambda x: _apply_rotary_pos_emb_thd(x, cu_seqlens, freqs,
                                                                 cp_group=_OneRankGroup()), leaves(t))
    assert_all_close(got, want, dtype)


# -------------------------------------------------------------------------------------------- softmax
def _softmax(mask_type, dtype, fusion=True):
    return FusedScaleMaskSoftmax(input_in_fp16=False, input_in_bf16=dtype == torch.bfloat16,
                                 attn_mask_type=mask_type, scaled_masked_softmax_fusion=fusion,
                                 mask_func=attention_mask_func, softmax_in_fp32=True, scale=0.5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_type", [AttnMaskType.causal, AttnMaskType.padding])
def test_scaled_masked_softmax_matches_megatron_torch_softmax(provider, mask_type, dtype, model_parallel):
    softmax = _softmax(mask_type, dtype)
    scores = randn(2, 4, 32, 64 if mask_type == AttnMaskType.padding else 32, dtype=dtype)
    mask = None
    if mask_type == AttnMaskType.padding:
        mask = torch.zeros(2, 1, 32, 64, dtype=torch.bool)
        mask[0, ..., 40:] = True
    want = forward_backward(lambda x: softmax.forward_torch_softmax(x, mask), leaves(scores))
    if provider.scaled_masked_softmax is None:
        # torch/cuda without apex's extension: megatron's torch softmax runs even with fusion requested
        assert not provider.softmax_fusable(softmax, mask, *scores.shape)
        got = forward_backward(lambda x: softmax(x, mask), leaves(scores))
    else:
        assert provider.softmax_fusable(softmax, mask, *scores.shape) == (dtype == torch.bfloat16)
        got = forward_backward(lambda x: provider.scaled_masked_softmax(softmax, x, mask), leaves(scores))
        called(provider, "npu_scaled_masked_softmax")
    assert_all_close(got, want, dtype)


def test_npu_softmax_is_not_used_where_its_kernel_cannot_run(npu_kernels):
    softmax = _softmax(AttnMaskType.causal, torch.bfloat16)
    assert not npu_kernels.softmax_fusable(softmax, None, 2, 4, 16, 16)  # below 32
    assert not npu_kernels.softmax_fusable(softmax, None, 2, 4, 48, 48)  # not a multiple of 32
    assert not npu_kernels.softmax_fusable(_softmax(AttnMaskType.causal, torch.bfloat16, fusion=False),
                                           None, 2, 4, 32, 32)
    windowed = _softmax(AttnMaskType.causal, torch.bfloat16)
    windowed.window_size = (8, 0)
    assert not npu_kernels.softmax_fusable(windowed, None, 2, 4, 32, 32)


# -------------------------------------------------------------------------------------- cross entropy
@pytest.mark.parametrize("dtype", DTYPES)
def test_cross_entropy_matches_megatron_vocab_parallel_cross_entropy(provider, dtype, model_parallel):
    if provider.vocab_parallel_cross_entropy is None:
        pytest.skip("the cuda provider keeps megatron's fused cross entropy (torch.compile'd; GPU only)")
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    logits, target = randn(6, 2, 50, dtype=dtype) * 3, torch.randint(0, 50, (6, 2))
    got = forward_backward(lambda x: provider.vocab_parallel_cross_entropy(x, target, group), leaves(logits))
    want = forward_backward(lambda x: vocab_parallel_cross_entropy(x.float(), target), leaves(logits))
    assert_all_close(got, want, dtype)
    called(provider, "npu_cross_entropy_loss")


# ---------------------------------------------------------------------------------- provider choice
def test_unknown_provider_is_refused_naming_the_choices(monkeypatch):
    monkeypatch.setenv("ADAPTER_KERNELS", "triton")
    with pytest.raises(kernels.KernelProviderUnavailable, match="'triton'.*npu, cuda, torch"):
        kernels.select_provider()


def test_npu_provider_without_torch_npu_says_what_is_missing():
    assert "torch_npu" not in sys.modules
    with pytest.raises(kernels.KernelProviderUnavailable, match="needs torch_npu"):
        kernels.select_provider("npu")


def test_provider_follows_the_backend_unless_overridden(monkeypatch):
    monkeypatch.delenv("ADAPTER_KERNELS", raising=False)
    assert kernels.select_provider().NAME == "torch"  # this machine's backend is cpu
    assert kernels.select_provider("CUDA").NAME == "cuda"


def test_every_provider_defines_the_whole_api(provider):
    assert [name for name in kernels.PROVIDER_API if not hasattr(provider, name)] == []
    assert provider.Norm is getattr(provider, f"{provider.NAME.capitalize()}Norm")
    assert (provider.Norm.rms_norm, provider.Norm.layer_norm) == (provider.rms_norm, provider.layer_norm)


def test_the_provider_base_adds_only_what_a_provider_left_out():
    from adapter.kernels import context_parallel, provider

    supplied = {name: object() for name in provider.REQUIRED}
    own_rope = object()
    namespace = {**supplied, "__name__": "somewhere.demo_provider", "NAME": "demo", "rope": own_rope}
    provider.complete(namespace)
    assert set(kernels.PROVIDER_API) <= set(namespace)
    assert namespace["rope"] is own_rope and namespace["scaled_masked_softmax"] is None
    assert namespace["installed_norm"]() is None and namespace["merge_with_lse"] is context_parallel.merge_with_lse
    assert namespace["Norm"] is namespace["DemoNorm"]
    assert (namespace["Norm"].__module__, namespace["Norm"].rms_norm) == ("somewhere.demo_provider",
                                                                          supplied["rms_norm"])


def test_a_provider_without_a_kernel_of_its_own_fails_at_import():
    from adapter.kernels import provider

    with pytest.raises(NotImplementedError, match="demo_provider defines no grouped_mm, moe_permute"):
        provider.complete({name: None for name in provider.REQUIRED if name not in ("grouped_mm", "moe_permute")}
                          | {"__name__": "demo_provider"})


def test_importing_adapter_leaves_megatron_unimported():
    import subprocess

    code = "import adapter, sys; print(sorted(m for m in sys.modules if m.startswith('megatron')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ------------------------------------------------------------------------ fusion flags and the config
def test_fused_interleaved_rope_config_needs_no_transformer_engine():
    config = attention_config(apply_rope_fusion=True, rotary_interleaved=True)
    assert config.apply_rope_fusion and config.rotary_interleaved


def test_fused_interleaved_rope_on_packed_sequences_is_refused(model_parallel):
    config = attention_config(groups=2, apply_rope_fusion=True, rotary_interleaved=True)
    module = kernels.core_attention_module(kernels.select_provider("torch"))(
        config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    bounds = torch.tensor([0, 16, 32], dtype=torch.int32)
    q, kv = randn(32, 8, 16), randn(32, 2, 16)
    with pytest.raises(kernels.UnsupportedKernelSetting, match="apply_rope_fusion=False"):
        module(q, kv, kv, None, packed_seq_params=PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds))


def test_fusion_flags_reach_the_provider_through_megatron():
    """With the flags on, megatron's own call sites land in the torch provider's functions."""
    from megatron.core.fusions import fused_cross_entropy
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.models.common.language_module import language_module

    torch_kernels = kernels.current()
    assert torch_kernels.NAME == "torch"
    assert rope_utils.fused_apply_rotary_pos_emb is torch_kernels.rope
    assert rope_utils.fused_apply_rotary_pos_emb_thd is torch_kernels.rope_thd
    assert language_module.fused_vocab_parallel_cross_entropy is torch_kernels.vocab_parallel_cross_entropy
    assert fused_cross_entropy.fused_vocab_parallel_cross_entropy is torch_kernels.vocab_parallel_cross_entropy
    assert FusedScaleMaskSoftmax.is_kernel_available is torch_kernels.softmax_fusable

"""Gated DeltaNet's kernels (adapter/kernels/gated_delta.py) against the rule token by token in float64
(tests/gated_delta_reference.py), transformers' torch fallbacks and megatron's ``torch_chunk_gated_delta_rule``,
forward and backward, at lengths that put chunk boundaries inside sequences, packed and not; every kernel
provider supplies them; and megatron's ``GatedDeltaNet`` layer, built without flash-linear-attention,
equals transformers' Qwen3.5 layer on the same weights."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from packaging.version import Version

from adapter.kernels import UnsupportedKernelSetting, cuda_provider, gated_delta, select_provider
from adapter.registry import installed_megatron_core_version
from tests.gated_delta_reference import causal_conv, recurrent_gated_delta_rule
from tests.kernel_reference import forward_backward, leaves, one_rank_model_parallel

# megatron's GatedDeltaNet with flash-linear-attention's interfaces, the one the adapter runs: 0.18 and later
NO_MEGATRON_GDN = (f"megatron-core {installed_megatron_core_version()}: GatedDeltaNet (and HybridModel) as the adapter "
                   "runs them come with 0.18" if Version(installed_megatron_core_version()) < Version("0.18") else None)
needs_megatron_gdn = pytest.mark.skipif(NO_MEGATRON_GDN is not None, reason=str(NO_MEGATRON_GDN))
# 150 tokens: chunks of 64 end inside the sequence and the last is partial; 2 key heads over 4 value heads
BATCH, SEQ, KEY_HEADS, VALUE_HEADS, DK, DV = 2, 150, 2, 4, 16, 24
PACKED = [0, 37, 150, 200]  # three sequences, the second crossing a chunk boundary


def _inputs(dtype=torch.float64, batch=BATCH, seq=SEQ, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    q, k = rand(batch, seq, KEY_HEADS, DK), rand(batch, seq, KEY_HEADS, DK) / DK ** 0.5
    v = rand(batch, seq, VALUE_HEADS, DV)
    g = -torch.rand(batch, seq, VALUE_HEADS, generator=generator, dtype=torch.float64)  # log-decay <= 0
    beta = torch.rand(batch, seq, VALUE_HEADS, generator=generator, dtype=torch.float64)
    return [t.to(dtype) for t in (q, k, v, g, beta)]


def _close(got, want, **tolerance):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b.double(), **tolerance)


@pytest.mark.parametrize("qk_l2norm", [True, False], ids=["l2norm-in-kernel", "normed-before"])
def test_chunks_equal_the_rule_token_by_token(qk_l2norm):
    inputs = _inputs()
    got = forward_backward(lambda *t: gated_delta.chunk_gated_delta_rule(*t, use_qk_l2norm_in_kernel=qk_l2norm)[0],
                           leaves(*inputs))
    want = forward_backward(lambda *t: recurrent_gated_delta_rule(*t, qk_l2norm=qk_l2norm), leaves(*inputs))
    _close(got, want, rtol=1e-9, atol=1e-10)


def _fla_shadows_transformers():
    if importlib.util.find_spec("fla") is not None:
        pytest.skip("flash-linear-attention is installed: transformers' functions call its Triton kernels instead "
                    "of their torch fallbacks, which this test compares with")


def _transformers_fallbacks():
    module = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next",
                                 reason="transformers >= 4.57 has Qwen3-Next's torch fallbacks")
    return module.torch_chunk_gated_delta_rule, module.torch_recurrent_gated_delta_rule


@pytest.mark.parametrize("reference", ["transformers-chunked", "transformers-recurrent", "megatron-chunked"])
def test_chunks_equal_transformers_and_megatrons_torch_fallbacks(reference):
    """float32, as those compute; megatron's takes the query/key heads already repeated to the value heads."""
    _fla_shadows_transformers()
    if reference == "megatron-chunked":
        if NO_MEGATRON_GDN:
            pytest.skip(NO_MEGATRON_GDN)
        from megatron.core.ssm.gated_delta_net import torch_chunk_gated_delta_rule

        def theirs(q, k, v, g, beta):
            q, k = (t.repeat_interleave(VALUE_HEADS // KEY_HEADS, dim=2) for t in (q, k))
            return torch_chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]
    else:
        chunked, recurrent = _transformers_fallbacks()
        function = chunked if reference == "transformers-chunked" else recurrent

        def theirs(q, k, v, g, beta):
            return function(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0]

    inputs = _inputs(torch.float32)
    got = forward_backward(lambda *t: gated_delta.chunk_gated_delta_rule(*t, use_qk_l2norm_in_kernel=True)[0],
                           leaves(*inputs))
    _close(got, forward_backward(theirs, leaves(*inputs)), rtol=2e-4, atol=2e-5)


def test_packed_sequences_each_start_from_a_zero_state():
    inputs = _inputs(batch=1, seq=PACKED[-1])
    cu_seqlens = torch.tensor(PACKED, dtype=torch.int32)
    got = forward_backward(lambda *t: gated_delta.chunk_gated_delta_rule(
        *t, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens)[0], leaves(*inputs))

    def one_by_one(*t):
        return torch.cat([recurrent_gated_delta_rule(*(x[:, a:b] for x in t), qk_l2norm=True)
                          for a, b in zip(PACKED, PACKED[1:])], dim=1)

    _close(got, forward_backward(one_by_one, leaves(*inputs)), rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("packed", [False, True], ids=["batch", "packed"])
def test_causal_convolution_sees_only_the_past_of_its_own_sequence(packed):
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(1 if packed else 2, PACKED[-1], 12, generator=generator, dtype=torch.float64)
    weight, bias = torch.randn(12, 4, generator=generator, dtype=torch.float64), torch.randn(12, dtype=torch.float64)
    cu_seqlens = torch.tensor(PACKED) if packed else None
    got = forward_backward(lambda x, w, b: gated_delta.causal_conv1d(x, w, b, activation="silu",
                                                                      cu_seqlens=cu_seqlens)[0],
                           leaves(x, weight, bias))
    if packed:
        def want_fn(x, w, b):
            return torch.cat([causal_conv(x[:, a:e], w, b) for a, e in zip(PACKED, PACKED[1:])], dim=1)
    else:
        want_fn = causal_conv
    _close(got, forward_backward(want_fn, leaves(x, weight, bias)), rtol=1e-12, atol=1e-12)


def test_causal_convolution_equals_transformers_fallback():
    _fla_shadows_transformers()
    causal_conv1d_fn = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next").causal_conv1d_fn
    generator = torch.Generator().manual_seed(4)
    x, weight = torch.randn(2, 40, 12, generator=generator), torch.randn(12, 4, generator=generator)
    got = gated_delta.causal_conv1d(x, weight, activation="silu")[0]
    torch.testing.assert_close(got, causal_conv1d_fn(x.transpose(1, 2), weight, None, "silu").transpose(1, 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_l2norm_in_float32_back_in_the_input_dtype(dtype):
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(5)).to(dtype)
    wide = x.double()
    got = gated_delta.l2norm(x)
    want = wide / torch.sqrt((wide * wide).sum(-1, keepdim=True) + 1e-6)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), want, rtol=1e-6 if dtype == torch.float32 else 8e-3, atol=0)


@pytest.mark.parametrize("call", ["rule-state-in", "rule-state-out", "conv-state-in", "conv-activation"])
def test_what_the_kernels_do_not_do_is_refused_naming_the_fix(call):
    q, k, v, g, beta = _inputs(torch.float32, seq=8)
    x, weight = torch.randn(1, 8, 4), torch.randn(4, 4)
    rule = gated_delta.chunk_gated_delta_rule
    calls = {"rule-state-in": lambda: rule(q, k, v, g, beta, initial_state=torch.zeros(1)),
             "rule-state-out": lambda: rule(q, k, v, g, beta, output_final_state=True),
             "conv-state-in": lambda: gated_delta.causal_conv1d(x, weight, initial_state=torch.zeros(1)),
             "conv-activation": lambda: gated_delta.causal_conv1d(x, weight, activation="gelu")}
    match = "use 'silu'" if call == "conv-activation" else "initial_state=None, output_final_state=False"
    with pytest.raises(UnsupportedKernelSetting, match=match):
        calls[call]()


def test_every_provider_supplies_the_kernels_or_leaves_flash_linear_attention(npu_kernels):
    for provider in (select_provider("torch"), npu_kernels, cuda_provider):  # cuda: no fla here
        assert (provider.chunk_gated_delta_rule, provider.causal_conv1d, provider.l2norm) == (
            gated_delta.chunk_gated_delta_rule, gated_delta.causal_conv1d, gated_delta.l2norm)
    assert cuda_provider.gated_delta_kernels(fla_runs=True) == (None, None, None)


# ------------------------------------------------------------------------------------------ the layer
def _qwen35_text_config():
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Qwen3_5TextConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no Qwen3.5 (5.23 and later do)")
    return transformers.Qwen3_5TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=DK,
        linear_value_head_dim=DV, linear_num_key_heads=KEY_HEADS, linear_num_value_heads=VALUE_HEADS,
        layer_types=["linear_attention"], rms_norm_eps=1e-6)


def _megatron_gdn(hf_config, zero_centered: bool):
    """megatron's GatedDeltaNet from local modules (the provider's norm for its output norm)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig

    from adapter import kernels

    config = TransformerConfig(
        num_layers=1, hidden_size=hf_config.hidden_size, num_attention_heads=2, use_cpu_initialization=True,
        activation_func=F.silu, normalization="RMSNorm", layernorm_epsilon=hf_config.rms_norm_eps,
        layernorm_zero_centered_gamma=zero_centered, linear_conv_kernel_dim=hf_config.linear_conv_kernel_dim,
        linear_key_head_dim=DK, linear_value_head_dim=DV, linear_num_key_heads=KEY_HEADS,
        linear_num_value_heads=VALUE_HEADS, add_bias_linear=False, cuda_graph_scope=[])
    submodules = GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=kernels.norm_module(),
                                         out_proj=RowParallelLinear)
    return GatedDeltaNet(config, submodules, layer_number=1,
                         pg_collection=ProcessGroupCollection.use_mpu_process_groups())


def _copy_weights(ours, theirs, zero_centered: bool) -> None:
    """transformers' Qwen3.5 linear-attention weights into megatron's: in_proj is [q, k, v, z, beta, alpha]
    rows (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a); a zero-centred norm stores gamma - 1."""
    with torch.no_grad():
        ours.in_proj.weight.copy_(torch.cat([theirs.in_proj_qkv.weight, theirs.in_proj_z.weight,
                                             theirs.in_proj_b.weight, theirs.in_proj_a.weight]))
        for name in ("conv1d.weight", "A_log", "dt_bias", "out_proj.weight"):
            ours.get_parameter(name).copy_(theirs.get_parameter(name))
        ours.out_norm.weight.copy_(theirs.norm.weight - (1 if zero_centered else 0))


@needs_megatron_gdn
@pytest.mark.parametrize("zero_centered", [False, True], ids=["gamma", "zero-centred-gamma"])
def test_megatrons_layer_without_flash_linear_attention_equals_transformers_qwen35(zero_centered):
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    _fla_shadows_transformers()
    hf_config = _qwen35_text_config()
    torch.manual_seed(0)
    theirs = Qwen3_5GatedDeltaNet(hf_config, layer_idx=0)
    with torch.no_grad():
        theirs.norm.weight.uniform_(0.5, 1.5)
    with one_rank_model_parallel():
        ours = _megatron_gdn(hf_config, zero_centered)
        _copy_weights(ours, theirs, zero_centered)
        x = torch.randn(2, SEQ, hf_config.hidden_size, generator=torch.Generator().manual_seed(6))
        got = forward_backward(lambda x: ours(x.transpose(0, 1), None)[0].transpose(0, 1), leaves(x))
        want = forward_backward(lambda x: theirs(x), leaves(x))
        _close(got + [ours.in_proj.weight.grad, ours.conv1d.weight.grad, ours.A_log.grad],
               want + [torch.cat([theirs.in_proj_qkv.weight.grad, theirs.in_proj_z.weight.grad,
                                  theirs.in_proj_b.weight.grad, theirs.in_proj_a.weight.grad]),
                       theirs.conv1d.weight.grad, theirs.A_log.grad], rtol=5e-4, atol=5e-5)

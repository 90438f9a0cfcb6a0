"""Core attention of every kernel provider against megatron's DotProductAttention: GQA 1/2/8, causal,
padding, padding+causal, sliding window, packed sequences, dropout, explicit scale, and the refusals."""

from __future__ import annotations

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType

from adapter import kernels
from tests.kernel_reference import (
    assert_all_close,
    attention_config,
    called,
    forward_backward,
    leaves,
    megatron_attention,
    one_rank_model_parallel,
    randn,
)

DTYPES = [torch.float32, torch.bfloat16]
SEQ, BATCH, HEADS, HEAD_DIM = 32, 2, 8, 16
KEY_LENGTHS = (32, 20)  # batch row 1 pads its last 12 keys


@pytest.fixture(scope="module", autouse=True)
def model_parallel():
    with one_rank_model_parallel():
        yield


def _qkv(groups: int, dtype, seq: int = SEQ, batch: int | None = BATCH):
    shape = (seq, batch) if batch is not None else (seq,)
    return (randn(*shape, HEADS, HEAD_DIM, dtype=dtype, seed=1),
            randn(*shape, groups, HEAD_DIM, dtype=dtype, seed=2),
            randn(*shape, groups, HEAD_DIM, dtype=dtype, seed=3))


def _key_padding_mask() -> torch.Tensor:
    mask = torch.zeros(BATCH, 1, SEQ, SEQ, dtype=torch.bool)
    for row, length in enumerate(KEY_LENGTHS):
        mask[row, ..., length:] = True
    return mask


def _ours(provider, config, mask_type, **kwargs):
    return kernels.core_attention_module(provider)(config, layer_number=1, attn_mask_type=mask_type,
                                                   attention_type="self", **kwargs)


def _causal(seq: int = SEQ) -> torch.Tensor:
    return torch.ones(seq, seq, dtype=torch.bool).triu(1)


CASES = {
    # mask type: (mask given to ours, mask type and mask given to megatron's DotProductAttention)
    "causal": (AttnMaskType.causal, lambda: None, AttnMaskType.causal, lambda: None),
    "padding": (AttnMaskType.padding, _key_padding_mask, AttnMaskType.padding, _key_padding_mask),
    "padding_causal": (AttnMaskType.padding_causal, _key_padding_mask,
                       AttnMaskType.padding, lambda: _key_padding_mask() | _causal()),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("groups", [8, 4, 1], ids=["mha", "gqa2", "gqa8"])
@pytest.mark.parametrize("case", list(CASES))
def test_attention_matches_megatron_dot_product_attention(provider, case, groups, dtype):
    ours_type, ours_mask, ref_type, ref_mask = CASES[case]
    config = attention_config(groups=groups, dtype=dtype)
    q, k, v = _qkv(groups, dtype)
    got = forward_backward(lambda *x: _ours(provider, config, ours_type)(*x, ours_mask()), leaves(q, k, v))
    want = forward_backward(lambda *x: megatron_attention(config, ref_type)(*x, ref_mask()), leaves(q, k, v))
    assert_all_close(got, want, dtype)
    called(provider, "npu_fusion_attention")


def test_causal_mask_type_ignores_the_mask_argument_as_transformer_engine_does(provider):
    """Megatron-LM's data loader hands the causal mask itself to a causal layer; TE ignores it and uses
    the kernel's causal mode, and so does every provider here."""
    config = attention_config(groups=4)
    module = _ours(provider, config, AttnMaskType.causal)
    q, k, v = _qkv(4, torch.float32)
    torch.testing.assert_close(module(q, k, v, _key_padding_mask()), module(q, k, v, None))


def test_gqa_reaches_the_npu_kernel_unexpanded(npu_kernels, monkeypatch):
    import torch_npu

    seen = {}
    real = torch_npu.npu_fusion_attention

    def spy(query, key, value, head_num, input_layout, **kwargs):
        seen.update(query=query.shape, key=key.shape, head_num=head_num, layout=input_layout, **kwargs)
        return real(query, key, value, head_num, input_layout, **kwargs)

    monkeypatch.setattr(torch_npu, "npu_fusion_attention", spy)
    config = attention_config(groups=1)
    _ours(npu_kernels, config, AttnMaskType.causal)(*_qkv(1, torch.float32), None)
    assert seen["layout"] == "SBH" and seen["head_num"] == HEADS
    assert seen["key"] == (SEQ, BATCH, HEAD_DIM)  # one key/value head, not repeated to eight
    assert seen["scale"] == pytest.approx(HEAD_DIM ** -0.5)  # never the kernel's default of 1.0
    assert seen["sparse_mode"] == 3 and seen["atten_mask"].shape == (2048, 2048)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sliding_window_matches_megatron(provider, dtype):
    config = attention_config(groups=4, dtype=dtype, window_size=(6, 0))
    q, k, v = _qkv(4, dtype)
    got = forward_backward(lambda *x: _ours(provider, config, AttnMaskType.causal)(*x, None), leaves(q, k, v))
    want = forward_backward(lambda *x: megatron_attention(config, AttnMaskType.causal)(*x, None),
                            leaves(q, k, v))
    assert_all_close(got, want, dtype)


def test_explicit_softmax_scale_is_honoured(provider):
    config = attention_config(groups=2)
    q, k, v = _qkv(2, torch.float32)
    got = forward_backward(lambda *x: _ours(provider, config, AttnMaskType.causal, softmax_scale=0.7)(*x, None),
                           leaves(q, k, v))
    want = forward_backward(
        lambda *x: megatron_attention(config, AttnMaskType.causal, softmax_scale=0.7)(*x, None), leaves(q, k, v))
    assert_all_close(got, want, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("groups", [8, 2])
def test_packed_sequences_match_megatron_per_sequence(provider, groups, dtype):
    lengths = [5, 11, 16]
    bounds = torch.tensor([0, 5, 16, 32], dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds,
                             max_seqlen_q=16, max_seqlen_kv=16)
    config = attention_config(groups=groups, dtype=dtype)
    q, k, v = _qkv(groups, dtype, batch=None)
    got = forward_backward(
        lambda *x: _ours(provider, config, AttnMaskType.causal)(*x, None, packed_seq_params=packed),
        leaves(q, k, v))

    reference = megatron_attention(config, AttnMaskType.causal)

    def per_sequence(q, k, v):
        pieces = [reference(*(t[s:e].unsqueeze(1) for t in (q, k, v)), None).squeeze(1)
                  for s, e in zip(bounds[:-1].tolist(), bounds[1:].tolist())]
        return torch.cat(pieces)

    want = forward_backward(per_sequence, leaves(q, k, v))
    assert_all_close(got, want, dtype)
    assert got[0].shape == (sum(lengths), HEADS * HEAD_DIM)


def test_torch_dropout_equals_megatron_dropout_under_the_rng_tracker():
    """Same tracker state, same probability tensor shape: the torch provider drops exactly what megatron
    drops, so dropout runs stay comparable."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    config = attention_config(groups=2, attention_dropout=0.3)
    q, k, v = _qkv(2, torch.float32)
    model_parallel_cuda_manual_seed(99)
    got = _ours(kernels.select_provider("torch"), config, AttnMaskType.causal)(q, k, v, None)
    model_parallel_cuda_manual_seed(99)
    want = megatron_attention(config, AttnMaskType.causal)(q, k, v, None)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    no_dropout = _ours(kernels.select_provider("torch"), config, AttnMaskType.causal).eval()(q, k, v, None)
    assert not torch.allclose(got, no_dropout)


def test_dropout_reaches_the_npu_kernel_as_keep_prob_only_in_training(npu_kernels, monkeypatch):
    import torch_npu

    keep = []
    real = torch_npu.npu_fusion_attention

    def spy(*args, **kwargs):
        keep.append(kwargs["keep_prob"])
        return real(*args, **kwargs)

    monkeypatch.setattr(torch_npu, "npu_fusion_attention", spy)
    module = _ours(npu_kernels, attention_config(groups=2, attention_dropout=0.25), AttnMaskType.causal)
    module(*_qkv(2, torch.float32), None)
    module.eval()(*_qkv(2, torch.float32), None)
    assert keep == [0.75, 1.0]


@pytest.mark.slow
@pytest.mark.parametrize("provider_name", ["torch", "cuda"])
def test_sdpa_and_torch_dropout_keep_the_expected_mean(provider_name):
    """Inverted dropout keeps E[output]: averaged over many draws it approaches the dropout-free output."""
    config = attention_config(groups=2, attention_dropout=0.5)
    module = _ours(kernels.select_provider(provider_name), config, AttnMaskType.causal)
    q, k, v = _qkv(2, torch.float32)
    mean = torch.stack([module(q, k, v, None) for _ in range(300)]).mean(0)
    exact = module.eval()(q, k, v, None)
    assert (mean - exact).abs().mean() < 0.1 * exact.abs().mean()


# ---------------------------------------------------------------------------------------------- refusals
def _refused(provider, match, config=None, mask_type=AttnMaskType.causal, mask=None, **forward):
    module = _ours(provider, config or attention_config(groups=2), mask_type)
    with pytest.raises(kernels.UnsupportedKernelSetting, match=match):
        module(*_qkv(2, torch.float32, batch=None if "packed_seq_params" in forward else BATCH), mask, **forward)


def test_attention_bias_is_refused(provider):
    _refused(provider, "attention_bias", attention_bias=torch.zeros(1))


def test_float_masks_are_refused(provider):
    _refused(provider, "bool mask", mask_type=AttnMaskType.padding, mask=torch.zeros(BATCH, 1, SEQ, SEQ))


def test_sliding_window_with_packed_sequences_is_refused(provider):
    bounds = torch.tensor([0, 16, 32], dtype=torch.int32)
    _refused(provider, "sliding window", config=attention_config(groups=2, window_size=(4, 0)),
             packed_seq_params=PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds))


def test_padded_packed_sequences_are_refused(provider):
    bounds = torch.tensor([0, 16, 32], dtype=torch.int32)
    padded = torch.tensor([0, 16, 34], dtype=torch.int32)
    _refused(provider, "padded", packed_seq_params=PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds, cu_seqlens_q_padded=padded))


def test_more_than_256_query_heads_per_rank_are_refused_on_npu(npu_kernels):
    q = torch.zeros(4, 1, 512, 8)
    kv = torch.zeros(4, 1, 8, 8)
    with pytest.raises(kernels.UnsupportedKernelSetting, match="512 query heads.*at most 256"):
        npu_kernels.attention(q, kv, kv, scale=1.0, causal=True, mask=None, window=None, dropout_p=0.0)


def test_context_parallel_and_offset_softmax_are_refused_at_construction(provider):
    with pytest.raises(kernels.UnsupportedKernelSetting, match="softmax_type='off-by-one'"):
        _ours(provider, attention_config(groups=2, softmax_type="off-by-one"), AttnMaskType.causal)

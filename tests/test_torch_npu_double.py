"""The torch_npu double's fused ops pin the semantics documented in shared/reference/torch_npu.md.

The attention tests mostly read the attention pattern directly instead of recomputing the op: with a zero
query every kept key scores the same, so with V = identity the output row i is the uniform distribution
over the keys row i may see (0 where masked).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

COMPRESSED = torch.triu(torch.ones(2048, 2048), 1).bool()


@pytest.fixture
def npu(torch_npu_double):
    torch.manual_seed(0)
    return torch_npu_double


def kept(npu, sq, skv, **kwargs):
    """Which keys each query row sees (bool [sq, skv]), read off the op through V = identity."""
    q = torch.zeros(1, 1, sq, skv)
    k = torch.randn(1, 1, skv, skv)
    v = torch.eye(skv).reshape(1, 1, skv, skv)
    out = npu.npu_fusion_attention(q, k, v, 1, "BNSD", **kwargs)[0][0, 0]
    return out > 0


def pattern(rows):
    return torch.tensor(rows, dtype=torch.bool)


def reference_attention(q, k, v, scale, masked=None):
    """Explicit softmax(scale * Q K^T) V in float64 on BNSD tensors with as many K/V heads as Q heads."""
    scores = scale * q.double() @ k.double().transpose(-2, -1)
    if masked is not None:
        scores = scores.masked_fill(masked, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v.double()).float()


# ---------------------------------------------------------------- CALLS
def test_calls_count_every_op_call_refused_ones_included(npu):
    x = torch.randn(2, 8)
    npu.npu_rms_norm(x, torch.ones(8))
    npu.npu_rms_norm(x, torch.ones(8))
    with pytest.raises(RuntimeError, match="even"):
        npu.npu_swiglu(torch.randn(2, 7))
    assert npu.CALLS == {"npu_rms_norm": 2, "npu_swiglu": 1}


# ---------------------------------------------------------------- npu_fusion_attention
def test_fa_scale_defaults_to_one_not_inverse_sqrt_d(npu):
    q, k, v = (torch.randn(1, 2, 4, 16) for _ in range(3))
    out = npu.npu_fusion_attention(q, k, v, 2, "BNSD")[0]
    torch.testing.assert_close(out, reference_attention(q, k, v, 1.0))
    scaled = npu.npu_fusion_attention(q, k, v, 2, "BNSD", scale=1 / math.sqrt(16))[0]
    torch.testing.assert_close(scaled, reference_attention(q, k, v, 0.25))
    assert not torch.allclose(out, scaled)


def test_fa_mask_true_means_masked_out(npu):
    q, k, v = (torch.randn(1, 1, 3, 8) for _ in range(3))
    mask = torch.zeros(3, 3, dtype=torch.bool)
    mask[:, 0] = True  # key 0 masked for every query
    out = npu.npu_fusion_attention(q, k, v, 1, "BNSD", atten_mask=mask, sparse_mode=1)[0]
    v_changed = v.clone()
    v_changed[0, 0, 0] += 100.0
    again = npu.npu_fusion_attention(q, k, v_changed, 1, "BNSD", atten_mask=mask, sparse_mode=1)[0]
    torch.testing.assert_close(out, again)
    unmasked = npu.npu_fusion_attention(q, k, v, 1, "BNSD", atten_mask=~mask, sparse_mode=1)[0]
    torch.testing.assert_close(unmasked, v[:, :, :1].expand_as(unmasked))  # only key 0 kept


def test_fa_causal_top_left_and_bottom_right_differ_when_sq_ne_skv(npu):
    top_left = kept(npu, 2, 4, atten_mask=COMPRESSED, sparse_mode=2)  # masked j > i
    bottom_right = kept(npu, 2, 4, atten_mask=COMPRESSED, sparse_mode=3)  # masked j > i + (4 - 2)
    assert torch.equal(top_left, pattern([[1, 0, 0, 0], [1, 1, 0, 0]]))
    assert torch.equal(bottom_right, pattern([[1, 1, 1, 0], [1, 1, 1, 1]]))


def test_fa_sparse_mode_0_bands_the_mask_and_mode_1_ignores_the_band(npu):
    none_masked = torch.zeros(4, 4, dtype=torch.bool)
    band = kept(npu, 4, 4, atten_mask=none_masked, sparse_mode=0, pre_tockens=1, next_tockens=0)
    assert torch.equal(band, pattern([[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]))
    full = kept(npu, 4, 4, atten_mask=none_masked, sparse_mode=1, pre_tockens=1, next_tockens=0)
    assert bool(full.all())


def test_fa_sparse_mode_4_is_a_bottom_right_band(npu):
    # shift = Skv - Sq = 2: kept where i + 2 - pre <= j <= i + 2 + next
    band = kept(npu, 2, 4, atten_mask=COMPRESSED, sparse_mode=4, pre_tockens=1, next_tockens=0)
    assert torch.equal(band, pattern([[0, 1, 1, 0], [0, 0, 1, 1]]))


def test_fa_no_mask_is_full_attention_whatever_sparse_mode_and_tockens(npu):
    assert bool(kept(npu, 3, 3, sparse_mode=2, pre_tockens=0, next_tockens=0).all())


@pytest.mark.parametrize("mask, error", [
    (torch.tril(torch.ones(2048, 2048), -1).bool(), "compressed"),
    (torch.triu(torch.ones(1024, 1024), 1).bool(), "compressed"),
    (torch.triu(torch.ones(2048, 2048), 1), "bool or uint8"),  # float
])
def test_fa_causal_modes_refuse_anything_but_the_compressed_mask(npu, mask, error):
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(RuntimeError, match=error):
        npu.npu_fusion_attention(q, q, q, 1, "BNSD", atten_mask=mask, sparse_mode=3)


def test_fa_accepts_the_compressed_mask_as_uint8(npu):
    causal = kept(npu, 3, 3, atten_mask=COMPRESSED.to(torch.uint8), sparse_mode=2)
    assert torch.equal(causal, torch.ones(3, 3).tril().bool())


def test_fa_mask_shapes_bnss_b1ss_11ss_ss_agree_and_others_are_refused(npu):
    q, k, v = torch.randn(2, 2, 3, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    ss = torch.rand(3, 5) > 0.5
    ss[:, 0] = False  # no fully masked row
    outs = [npu.npu_fusion_attention(q, k, v, 2, "BNSD", atten_mask=m, sparse_mode=1)[0]
            for m in (ss, ss.expand(1, 1, 3, 5), ss.expand(2, 1, 3, 5), ss.expand(2, 2, 3, 5))]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0])
    with pytest.raises(RuntimeError, match="atten_mask shape"):
        npu.npu_fusion_attention(q, k, v, 2, "BNSD", atten_mask=torch.zeros(2, 2, 3, 4, dtype=torch.bool))


def test_fa_fully_masked_row_gives_zeros(npu):
    q, k, v = (torch.randn(1, 1, 2, 8) for _ in range(3))
    mask = pattern([[1, 1], [0, 1]])
    out = npu.npu_fusion_attention(q, k, v, 1, "BNSD", atten_mask=mask, sparse_mode=1)[0]
    assert torch.equal(out[0, 0, 0], torch.zeros(8))
    torch.testing.assert_close(out[0, 0, 1], v[0, 0, 0])


@pytest.mark.parametrize("sparse_mode, mask", [(None, None), (3, COMPRESSED)])
def test_fa_tnd_equals_separate_calls_per_sequence(npu, sparse_mode, mask):
    # Skv_i >= Sq_i: bottom-right causal on a sequence with more queries than keys masks whole rows,
    # which varlen refuses (test_fa_tnd_refuses_a_fully_masked_query_row)
    q_lens, kv_lens = [2, 2, 2], [3, 2, 3]
    q, k, v = torch.randn(6, 2, 8), torch.randn(8, 2, 8), torch.randn(8, 2, 8)
    extra = {} if mask is None else {"atten_mask": mask, "sparse_mode": sparse_mode}
    packed = npu.npu_fusion_attention(q, k, v, 2, "TND", actual_seq_qlen=[2, 4, 6], actual_seq_kvlen=[3, 5, 8],
                                      scale=0.3, **extra)
    assert packed[0].shape == (6, 2, 8)
    assert packed[1].shape == packed[2].shape == (6, 2, 8)
    q_parts, k_parts, v_parts = q.split(q_lens), k.split(kv_lens), v.split(kv_lens)
    for i, (qi, ki, vi) in enumerate(zip(q_parts, k_parts, v_parts)):
        alone = npu.npu_fusion_attention(qi[None], ki[None], vi[None], 2, "BSND", scale=0.3, **extra)
        torch.testing.assert_close(packed[0][2 * i:2 * i + 2], alone[0][0])
        torch.testing.assert_close(packed[1][2 * i:2 * i + 2], alone[1][0].transpose(0, 1))


def test_fa_tnd_applies_an_ss_mask_top_left_per_sequence(npu):
    q, k, v = torch.randn(4, 1, 8), torch.randn(5, 1, 8), torch.randn(5, 1, 8)
    mask = pattern([[0, 1, 0, 1], [0, 0, 1, 1]])  # [max Sq, max Skv]
    packed = npu.npu_fusion_attention(q, k, v, 1, "TND", atten_mask=mask, sparse_mode=1,
                                      actual_seq_qlen=[2, 4], actual_seq_kvlen=[3, 5])[0]
    first = npu.npu_fusion_attention(q[None, :2], k[None, :3], v[None, :3], 1, "BSND", atten_mask=mask[:, :3],
                                     sparse_mode=1)[0][0]
    second = npu.npu_fusion_attention(q[None, 2:], k[None, 3:], v[None, 3:], 1, "BSND", atten_mask=mask[:, :2],
                                      sparse_mode=1)[0][0]
    torch.testing.assert_close(packed, torch.cat((first, second)))


@pytest.mark.parametrize("qlen, kvlen, mask, sparse_mode", [
    ([2, 4], [1, 4], COMPRESSED, 3),  # sequence 0: Sq=2 > Skv=1, bottom-right causal masks row 0 whole
    ([2, 4], [2, 4], pattern([[0, 0], [1, 1]]), 1),  # the given SS mask masks row 1 of every sequence whole
    ([2, 4], [2, 4], torch.zeros(2, 2, dtype=torch.bool), 0),  # the band: next_tockens=-1 leaves row 0 no key
])
def test_fa_tnd_refuses_a_fully_masked_query_row(npu, qlen, kvlen, mask, sparse_mode):
    # the reference: "varlen: SS only; no fully masked row"
    q, kv = torch.randn(4, 1, 8), torch.randn(4, 1, 8)
    with pytest.raises(RuntimeError, match="atten_mask .* allows no fully masked row"):
        npu.npu_fusion_attention(q, kv, kv, 1, "TND", atten_mask=mask, sparse_mode=sparse_mode, next_tockens=-1,
                                 actual_seq_qlen=qlen, actual_seq_kvlen=kvlen)


@pytest.mark.parametrize("qlen, error", [
    ([2, 2, 2], "strictly increasing CUMULATIVE"),
    ([0, 3, 6], "strictly increasing CUMULATIVE"),  # a leading 0
    ([2, 4, 5], "must end at the packed length T=6"),
    (torch.tensor([2, 4, 6]), "list of Python ints"),
    (None, "list of Python ints"),
])
def test_fa_tnd_refuses_non_cumulative_sequence_lengths(npu, qlen, error):
    q = torch.randn(6, 1, 8)
    with pytest.raises(RuntimeError, match=error):
        npu.npu_fusion_attention(q, q, q, 1, "TND", actual_seq_qlen=qlen, actual_seq_kvlen=[2, 4, 6])


def test_fa_gqa_query_head_h_reads_kv_head_h_over_group(npu):
    q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    out = npu.npu_fusion_attention(q, k, v, 4, "BNSD", scale=0.5)[0]
    expanded = npu.npu_fusion_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), 4, "BNSD",
                                        scale=0.5)[0]
    torch.testing.assert_close(out, expanded)
    tiled = npu.npu_fusion_attention(q, k.repeat(1, 2, 1, 1), v.repeat(1, 2, 1, 1), 4, "BNSD", scale=0.5)[0]
    assert not torch.allclose(out, tiled)  # h // 2, not h % 2


def test_fa_layouts_agree_after_transposition(npu):
    b, s, n, d = 2, 3, 4, 8
    q, k, v = (torch.randn(b, n, s, d) for _ in range(3))  # BNSD
    bnsd = npu.npu_fusion_attention(q, k, v, n, "BNSD", scale=0.5)[0]
    bsnd = npu.npu_fusion_attention(*(t.transpose(1, 2) for t in (q, k, v)), n, "BSND", scale=0.5)[0]
    bsh = npu.npu_fusion_attention(*(t.transpose(1, 2).reshape(b, s, n * d) for t in (q, k, v)), n, "BSH",
                                   scale=0.5)[0]
    sbh = npu.npu_fusion_attention(*(t.permute(2, 0, 1, 3).reshape(s, b, n * d) for t in (q, k, v)), n, "SBH",
                                   scale=0.5)[0]
    torch.testing.assert_close(bsnd, bnsd.transpose(1, 2))
    torch.testing.assert_close(bsh, bnsd.transpose(1, 2).reshape(b, s, n * d))
    torch.testing.assert_close(sbh, bnsd.permute(2, 0, 1, 3).reshape(s, b, n * d))


def test_fa_returns_the_seven_documented_outputs(npu):
    q, k, v = (torch.randn(2, 3, 4, 8, dtype=torch.bfloat16) for _ in range(3))
    out, s_max, s_sum, s_out, seed, offset, numels = npu.npu_fusion_attention(q, k, v, 3, "BNSD", scale=0.5)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 3, 4, 8)
    assert s_max.dtype == s_sum.dtype == torch.float32 and s_max.shape == s_sum.shape == (2, 3, 4, 8)
    scores = 0.5 * q.float() @ k.float().transpose(-2, -1)
    torch.testing.assert_close(s_max[..., 5], scores.amax(-1))
    torch.testing.assert_close(s_sum[..., 0], torch.exp(scores - scores.amax(-1, keepdim=True)).sum(-1))
    assert s_out.numel() == 0
    assert all(isinstance(x, int) for x in (seed, offset, numels)) and numels == 2 * 3 * 4 * 4


def test_fa_keep_prob_drops_probabilities_and_rescales(npu):
    dropped = npu.npu_fusion_attention(torch.zeros(1, 1, 64, 4), torch.randn(1, 1, 4, 4),
                                       torch.eye(4).reshape(1, 1, 4, 4), 1, "BNSD", keep_prob=0.5)[0]
    values = set(dropped.unique().tolist())
    assert values == {0.0, 0.5}  # uniform 1/4, kept ones scaled by 1/keep_prob
    with pytest.raises(RuntimeError, match="keep_prob"):
        npu.npu_fusion_attention(*(torch.randn(1, 1, 2, 4) for _ in range(3)), 1, "BNSD", keep_prob=0.0)


@pytest.mark.parametrize("change, error", [
    ({"key": torch.randn(1, 2, 3, 8, dtype=torch.float16)}, "share a dtype"),
    ({"query": torch.randn(1, 3, 3, 8), "head_num": 3}, "multiple of the key/value head count"),
    ({"value": torch.randn(1, 2, 4, 8)}, "same shape"),
    ({"value": torch.randn(1, 2, 3, 16)}, "Dv <= Dk"),
    ({"query": torch.randn(1, 2, 3, 800), "key": torch.randn(1, 2, 3, 800)}, "<= 768"),
    ({"head_num": 3}, "head_num 3 must equal query's N"),
    ({"input_layout": "BHSD"}, "input_layout"),
    ({"atten_mask": torch.zeros(3, 3)}, "bool or uint8"),
    ({"actual_seq_qlen": [3]}, "TND only"),
])
def test_fa_refuses_what_the_kernel_rejects(npu, change, error):
    args = {"query": torch.randn(1, 2, 3, 8), "key": torch.randn(1, 2, 3, 8), "value": torch.randn(1, 2, 3, 8),
            "head_num": 2, "input_layout": "BNSD", **change}
    with pytest.raises(RuntimeError, match=error):
        npu.npu_fusion_attention(**args)


def test_fa_value_head_narrower_than_query_key_as_multi_latent_attention(npu):
    """Dq == Dk > Dv (MLA's 192-wide query/key heads over 128-wide value heads) runs, SBH and BNSD alike."""
    q, k, v = torch.randn(1, 4, 5, 12), torch.randn(1, 2, 5, 12), torch.randn(1, 2, 5, 8)
    ref = torch.softmax(0.3 * q @ k.repeat_interleave(2, 1).transpose(-2, -1), -1) @ v.repeat_interleave(2, 1)
    out = npu.npu_fusion_attention(q, k, v, 4, "BNSD", scale=0.3)[0]
    torch.testing.assert_close(out, ref)
    sbh = lambda t: t.permute(2, 0, 1, 3).flatten(2)  # noqa: E731
    out = npu.npu_fusion_attention(sbh(q), sbh(k), sbh(v), 4, "SBH", scale=0.3)[0]
    torch.testing.assert_close(out, sbh(ref))


def test_fa_refuses_too_many_heads_and_unmodelled_features(npu):
    q = torch.randn(1, 512, 1, 8)
    with pytest.raises(RuntimeError, match="<= 256"):
        npu.npu_fusion_attention(q, q, q, 512, "BNSD")
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(NotImplementedError, match="sparse_mode 6 is not modelled by the double"):
        npu.npu_fusion_attention(q, q, q, 1, "BNSD", atten_mask=COMPRESSED, sparse_mode=6)
    with pytest.raises(NotImplementedError, match="pse"):
        npu.npu_fusion_attention(q, q, q, 1, "BNSD", pse=torch.zeros(1, 1, 4, 4))


def test_fa_gradients_match_the_explicit_formula(npu):
    q, k, v = (torch.randn(1, 2, 4, 8, requires_grad=True) for _ in range(3))
    causal = torch.ones(4, 4).triu(1).bool()
    out = npu.npu_fusion_attention(q, k, v, 2, "BNSD", scale=0.4, atten_mask=causal, sparse_mode=1)[0]
    weights = torch.randn_like(out)
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    expected = torch.autograd.grad((reference_attention(q, k, v, 0.4, causal) * weights).sum(), (q, k, v))
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want)


# ---------------------------------------------------------------- npu_rms_norm
def test_rms_norm_formula_dtypes_and_rstd_shape(npu):
    x = torch.tensor([[3.0, 4.0], [1.0, 1.0]], dtype=torch.bfloat16)
    y, rstd = npu.npu_rms_norm(x, torch.tensor([1.0, 2.0], dtype=torch.bfloat16), epsilon=0.0)
    assert y.dtype == torch.bfloat16 and rstd.dtype == torch.float32 and rstd.shape == (2, 1)
    torch.testing.assert_close(rstd, torch.tensor([[1 / math.sqrt(12.5)], [1.0]]))
    torch.testing.assert_close(y, torch.tensor([[3 / math.sqrt(12.5), 8 / math.sqrt(12.5)], [1.0, 2.0]],
                                               dtype=torch.bfloat16))


def test_rms_norm_normalises_over_all_of_gammas_dims(npu):
    x = torch.randn(2, 3, 4)
    y, rstd = npu.npu_rms_norm(x, torch.ones(3, 4))
    assert rstd.shape == (2, 1, 1)
    torch.testing.assert_close(y.pow(2).mean(dim=(1, 2)), torch.ones(2), atol=1e-4, rtol=1e-4)
    with pytest.raises(RuntimeError, match="gamma shape"):
        npu.npu_rms_norm(x, torch.ones(3))
    with pytest.raises(RuntimeError, match="x dtype"):
        npu.npu_rms_norm(x.double(), torch.ones(4))


# ---------------------------------------------------------------- npu_swiglu
def test_swiglu_gates_the_first_half(npu):
    x = torch.tensor([[1.0, -2.0, 3.0, 0.5]])
    out = npu.npu_swiglu(x)
    torch.testing.assert_close(out, F.silu(x[:, :2]) * x[:, 2:])
    assert not torch.allclose(out, F.silu(x[:, 2:]) * x[:, :2])
    along_0 = npu.npu_swiglu(x.T.contiguous(), dim=0)
    torch.testing.assert_close(along_0, out.T)


# ---------------------------------------------------------------- npu_rotary_mul
def test_rotary_half_and_interleave_on_a_hand_computed_example(npu):
    x = torch.tensor([1.0, 2.0, 3.0, 4.0]).reshape(1, 1, 1, 4)
    cos = torch.tensor([0.5, 0.0, 0.5, 0.0]).reshape(1, 1, 1, 4)
    sin = torch.tensor([2.0, 1.0, 2.0, 1.0]).reshape(1, 1, 1, 4)
    # half: rotate_half(x) = [-3, -4, 1, 2]
    half = npu.npu_rotary_mul(x, cos, sin)
    assert half.flatten().tolist() == [0.5 - 6.0, -4.0, 1.5 + 2.0, 2.0]
    # interleave: pairs (1, 2), (3, 4) -> rotated [-2, 1, -4, 3]
    inter = npu.npu_rotary_mul(x, cos, sin, rotary_mode="interleave")
    assert inter.flatten().tolist() == [0.5 - 4.0, 1.0, 1.5 - 8.0, 3.0]


@pytest.mark.parametrize("x, r, mode, error", [
    (torch.randn(2, 4, 8), torch.randn(1, 4, 8), "half", "4-D"),
    (torch.randn(1, 2, 3, 7), torch.randn(1, 1, 3, 7), "half", "even"),
    (torch.randn(1, 1, 1, 896), torch.randn(1, 1, 1, 896), "half", "< 896"),
    (torch.randn(1, 2, 3, 8), torch.randn(1, 1, 4, 8), "half", "r1 shape"),
    (torch.randn(1, 2, 3, 8), torch.randn(1, 1, 3, 8), "quarter", "rotary_mode"),
    # torch would broadcast these; the kernel takes 4-D r1/r2 over the full head dim in a documented layout
    (torch.randn(1, 2, 3, 8), torch.randn(3, 8), "half", "r1 shape .* must be 4-D"),
    (torch.randn(1, 2, 3, 8), torch.randn(1, 1, 3, 1), "half", "r1 shape .* full head dim D=8"),
    (torch.randn(1, 2, 3, 8), torch.randn(1, 1, 3, 4), "interleave", "r1 shape .* full head dim D=8"),
    (torch.randn(2, 2, 3, 8), torch.randn(1, 1, 1, 8), "half", "r1 shape"),  # 111D: no layout's
    (torch.randn(2, 2, 3, 8), torch.randn(1, 2, 3, 8), "half", "r1 shape"),  # 1NSD: no layout's
])
def test_rotary_refuses_what_the_kernel_rejects(npu, x, r, mode, error):
    with pytest.raises(RuntimeError, match=error):
        npu.npu_rotary_mul(x, r, r, rotary_mode=mode)


@pytest.mark.parametrize("r_shape", [
    (1, 1, 4, 8), (2, 1, 4, 8), (2, 3, 4, 8),  # against BNSD x: 11SD, B1SD, BNSD
    (1, 3, 1, 8), (2, 3, 1, 8), (2, 1, 1, 8),  # against BSND x: 1S1D, BS1D (and SBND's S11D)
])
def test_rotary_accepts_each_documented_r_layout(npu, r_shape):
    x, r1, r2 = torch.randn(2, 3, 4, 8), torch.randn(r_shape), torch.randn(r_shape)
    rotated = torch.cat((-x[..., 4:], x[..., :4]), dim=-1)
    torch.testing.assert_close(npu.npu_rotary_mul(x, r1, r2), r1 * x + r2 * rotated)


# ---------------------------------------------------------------- npu_cross_entropy_loss
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_matches_torch(npu, reduction):
    logits = torch.randn(5, 7)
    target = torch.tensor([0, 6, 3, 3, 1])
    loss, log_prob, zloss, lse = npu.npu_cross_entropy_loss(logits, target, reduction=reduction, ignore_index=3,
                                                            label_smoothing=0.1)
    torch.testing.assert_close(loss, F.cross_entropy(logits, target, reduction=reduction, ignore_index=3,
                                                     label_smoothing=0.1))
    torch.testing.assert_close(log_prob, torch.log_softmax(logits, -1))
    torch.testing.assert_close(lse, torch.logsumexp(logits, -1))
    assert torch.equal(zloss, torch.zeros_like(loss))


def test_cross_entropy_dtypes_and_refusals(npu):
    logits = torch.randn(3, 4, dtype=torch.bfloat16)
    loss, log_prob, _, lse = npu.npu_cross_entropy_loss(logits, torch.tensor([0, 1, 2]))
    assert loss.dtype == torch.bfloat16 and log_prob.dtype == lse.dtype == torch.float32
    with pytest.raises(RuntimeError, match=r"target values must be in \[0, C=4\)"):
        npu.npu_cross_entropy_loss(logits, torch.tensor([0, -100, 2]))  # -100 labels are not ignored
    with pytest.raises(RuntimeError, match="target must be an int64"):
        npu.npu_cross_entropy_loss(logits, torch.tensor([0, 1, 2], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="2-D"):
        npu.npu_cross_entropy_loss(logits[None], torch.tensor([0, 1, 2]))
    with pytest.raises(NotImplementedError, match="weight"):
        npu.npu_cross_entropy_loss(logits, torch.tensor([0, 1, 2]), weight=torch.ones(4))
    with pytest.raises(NotImplementedError, match="z-loss"):
        npu.npu_cross_entropy_loss(logits, torch.tensor([0, 1, 2]), return_zloss=True)


def test_cross_entropy_ignore_index_below_zero_ignores_nothing_and_must_be_an_int_below_c(npu):
    # Ascend's API page: ignore_index "must be less than C; below 0 means no label is ignored"
    logits, target = torch.randn(4, 5), torch.tensor([0, 1, 2, 2])
    torch.testing.assert_close(npu.npu_cross_entropy_loss(logits, target, ignore_index=-1)[0],
                               F.cross_entropy(logits, target))
    ignoring_2 = npu.npu_cross_entropy_loss(logits, target, ignore_index=2, reduction="none")[0]
    assert ignoring_2[2:].eq(0).all() and ignoring_2[:2].gt(0).all()
    for bad in (5, 2.0, True):
        with pytest.raises(RuntimeError, match="ignore_index must be an int < C=5"):
            npu.npu_cross_entropy_loss(logits, target, ignore_index=bad)


# ---------------------------------------------------------------- npu_scaled_masked_softmax
def test_scaled_masked_softmax_masks_true_positions_and_scales(npu):
    x = torch.randn(2, 1, 32, 64, dtype=torch.float16)
    mask = torch.rand(1, 1, 32, 64) > 0.5
    mask[..., 0] = False
    out = npu.npu_scaled_masked_softmax(x, mask, scale=0.5)
    assert out.dtype == torch.float16 and out.shape == x.shape
    assert bool((out[mask.expand_as(out)] == 0).all())
    expected = torch.softmax((0.5 * x.float()).masked_fill(mask, float("-inf")), dim=-1)
    torch.testing.assert_close(out.float(), expected, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("x_shape, mask, kwargs, error", [
    ((1, 1, 32, 16), None, {}, "size 16 along dim -1"),
    ((1, 1, 48, 32), None, {}, "size 48 along dim -2"),
    ((1, 1, 32, 32), torch.zeros(1, 1, 32, 32), {}, "mask must be a bool"),
    ((1, 1, 32, 32), torch.zeros(32, 32, dtype=torch.bool), {}, "4-D"),
    ((1, 1, 32, 32), None, {"fixed_triu_mask": True}, "reserved"),
])
def test_scaled_masked_softmax_refuses_what_the_kernel_rejects(npu, x_shape, mask, kwargs, error):
    mask = torch.zeros(x_shape, dtype=torch.bool) if mask is None else mask
    with pytest.raises(RuntimeError, match=error):
        npu.npu_scaled_masked_softmax(torch.randn(x_shape), mask, **kwargs)


# ---------------------------------------------------------------- autograd of the elementwise ops
@pytest.mark.parametrize("op", ["rms_norm", "swiglu", "rotary_half", "rotary_interleave"])
def test_gradients_match_finite_differences(npu, op):
    x = torch.randn(1, 2, 3, 8)
    r1, r2 = torch.randn(1, 1, 3, 8), torch.randn(1, 1, 3, 8)
    gamma = torch.randn(8)
    fn = {
        "rms_norm": lambda t: npu.npu_rms_norm(t, gamma)[0],
        "swiglu": lambda t: npu.npu_swiglu(t),
        "rotary_half": lambda t: npu.npu_rotary_mul(t, r1, r2),
        "rotary_interleave": lambda t: npu.npu_rotary_mul(t, r1, r2, rotary_mode="interleave"),
    }[op]
    weights = torch.randn_like(fn(x))
    x.requires_grad_(True)
    (grad,) = torch.autograd.grad((fn(x) * weights).sum(), x)
    step = 1e-2
    for index in [(0, 0, 0, 0), (0, 1, 2, 5), (0, 0, 1, 7)]:
        plus, minus = x.detach().clone(), x.detach().clone()
        plus[index] += step
        minus[index] -= step
        numeric = ((fn(plus) * weights).sum() - (fn(minus) * weights).sum()) / (2 * step)
        assert abs(grad[index].item() - numeric.item()) < 2e-2, (index, grad[index].item(), numeric.item())


# ---------------------------------------------------------------- MoE: npu_grouped_matmul
def loop_gmm(x, weights, ends):
    """Independent reference: rows ends[e-1]:ends[e] of x times weights[e], one matmul per expert, float64."""
    outs, start = [], 0
    for weight, end in zip(weights, ends):
        outs.append(x[start:end].double() @ weight.double())
        start = end
    return torch.cat(outs)


@pytest.mark.parametrize("group_list, group_type, group_list_type", [
    (torch.tensor([2, 2, 5, 7]), 0, 0),  # cumulative ends; expert 1 gets no rows
    (torch.tensor([2, 0, 3, 2]), 0, 1),  # the same groups as counts
    ([2, 2, 5, 7], None, 0),  # a Python list: cumulative, group_type None
])
def test_gmm_split_m_matches_a_per_expert_loop(npu, group_list, group_type, group_list_type):
    x = torch.randn(7, 6)
    w = torch.randn(4, 5, 6).transpose(1, 2)  # [E, K, N] as a transposed view of [E, N, K], as MindSpeed passes it
    out = npu.npu_grouped_matmul([x], [w], group_list=group_list, split_item=3, group_type=group_type,
                                 group_list_type=group_list_type)
    assert len(out) == 1 and out[0].shape == (7, 5)
    torch.testing.assert_close(out[0], loop_gmm(x, w, [2, 2, 5, 7]).float())


def test_gmm_split_item_0_gives_one_output_per_group_with_list_weights_and_bias(npu):
    x, weights, bias = torch.randn(6, 4), [torch.randn(4, 3) for _ in range(3)], torch.randn(3, 3)
    outs = npu.npu_grouped_matmul([x], weights, bias=[bias], group_list=torch.tensor([1, 1, 6]), split_item=0,
                                  group_type=0)
    assert [tuple(o.shape) for o in outs] == [(1, 3), (0, 3), (5, 3)]
    for out, rows, weight, b in zip(outs, (x[:1], x[1:1], x[1:]), weights, bias):
        torch.testing.assert_close(out, rows @ weight + b)


def test_gmm_split_k_gives_each_experts_weight_grad_and_zeros_for_an_empty_group(npu):
    x, dy = torch.randn(7, 4), torch.randn(7, 3)
    out = npu.npu_grouped_matmul([x.t()], [dy], group_list=torch.tensor([3, 3, 7]), split_item=3, group_type=2)[0]
    assert out.shape == (3, 4, 3)
    # independent: the weight grads autograd gives a per-expert loop forward with upstream gradient dy
    w = torch.randn(3, 4, 3, dtype=torch.float64, requires_grad=True)
    (expected,) = torch.autograd.grad((loop_gmm(x, w, [3, 3, 7]) * dy.double()).sum(), w)
    torch.testing.assert_close(out, expected.float())
    assert torch.equal(out[1], torch.zeros(4, 3))


def test_gmm_without_group_list_runs_independent_matmuls(npu):
    x, w = [torch.randn(2, 3), torch.randn(4, 5)], [torch.randn(3, 6), torch.randn(5, 6)]
    apart = npu.npu_grouped_matmul(x, w)
    assert len(apart) == 2
    for out, xi, wi in zip(apart, x, w):
        torch.testing.assert_close(out, xi @ wi)
    joined = npu.npu_grouped_matmul(x, w, split_item=2, group_type=-1)
    torch.testing.assert_close(joined[0], torch.cat(apart))


def test_gmm_outputs_carry_no_gradient_as_the_real_op_has_no_backward(npu):
    x, w = torch.randn(4, 3, requires_grad=True), torch.randn(2, 3, 5, requires_grad=True)
    forward = npu.npu_grouped_matmul([x], [w], group_list=torch.tensor([1, 4]), split_item=3, group_type=0)[0]
    grads = npu.npu_grouped_matmul([x.t()], [torch.randn(4, 5)], group_list=torch.tensor([1, 4]), split_item=3,
                                   group_type=2)[0]
    for out in (forward, grads):
        assert out.grad_fn is None and not out.requires_grad
    assert npu.CALLS["npu_grouped_matmul"] == 2


def test_gmm_bf16_is_one_rounding_of_a_float32_result(npu):
    x, w = torch.randn(9, 16, dtype=torch.bfloat16), torch.randn(3, 16, 8, dtype=torch.bfloat16)
    out = npu.npu_grouped_matmul([x], [w], group_list=torch.tensor([4, 4, 9]), split_item=3, group_type=0)[0]
    assert out.dtype == torch.bfloat16
    # float32 accumulation, then one bf16 rounding: relative error <= 2**-9 (tolerance 2**-8)
    torch.testing.assert_close(out.double(), loop_gmm(x, w, [4, 4, 9]), rtol=2 ** -8, atol=1e-5)


# ---------------------------------------------------------------- MoE: token permute / unpermute, index form
def loop_permute(tokens, indices):
    """Independent reference: for each expert in ascending order, the token of each flat entry t*k+j naming it,
    in flat order; and the position each flat entry lands at."""
    k, flat = indices.shape[1], indices.reshape(-1).tolist()
    order = [i for expert in sorted(set(flat)) for i in range(len(flat)) if flat[i] == expert]
    position = [order.index(i) for i in range(len(flat))]
    return torch.stack([tokens[i // k] for i in order]), position


INDICES = torch.tensor([[3, 0], [0, 3], [2, 0], [3, 2], [0, 2]])  # T=5, k=2; expert 1 gets no token


def test_permute_orders_by_expert_then_flat_index_and_returns_the_inverse(npu):
    tokens = torch.randn(5, 4)
    permuted, sorted_indices = npu.npu_moe_token_permute(tokens, INDICES)
    expected, position = loop_permute(tokens, INDICES)
    assert torch.equal(permuted, expected)
    assert sorted_indices.dtype == torch.int32 and sorted_indices.tolist() == position
    for i in range(10):
        assert torch.equal(permuted[sorted_indices[i]], tokens[i // 2])
    alone, alone_indices = npu.npu_moe_token_permute(tokens, INDICES[:, 0].int())  # [T]: k = 1
    assert torch.equal(alone, loop_permute(tokens, INDICES[:, :1])[0])
    assert alone_indices.tolist() == loop_permute(tokens, INDICES[:, :1])[1]


@pytest.mark.parametrize("num_out_tokens, rows", [(None, 10), (0, 10), (6, 6), (25, 10), (-3, 7)])
def test_permute_num_out_tokens_keeps_the_first_sorted_rows_but_not_fewer_indices(npu, num_out_tokens, rows):
    tokens = torch.randn(5, 4)
    permuted, sorted_indices = npu.npu_moe_token_permute(tokens, INDICES, num_out_tokens=num_out_tokens)
    assert torch.equal(permuted, loop_permute(tokens, INDICES)[0][:rows])
    assert sorted_indices.shape == (10,)


def test_unpermute_sums_each_tokens_rows_weighted_by_probs(npu):
    _, sorted_indices = npu.npu_moe_token_permute(torch.randn(5, 4), INDICES)
    permuted, probs = torch.randn(10, 4), torch.rand(5, 2)
    out = npu.npu_moe_token_unpermute(permuted, sorted_indices, probs)
    s = sorted_indices.tolist()
    expected = torch.stack([sum(probs[t, j] * permuted[s[t * 2 + j]] for j in range(2)) for t in range(5)])
    torch.testing.assert_close(out, expected)
    unweighted = npu.npu_moe_token_unpermute(permuted, sorted_indices)  # no probs: k = 1, one row per entry
    assert torch.equal(unweighted, permuted[sorted_indices.long()])


def test_permute_then_unpermute_restores_the_tokens_scaled_by_their_probs(npu):
    tokens, probs = torch.randn(5, 4), torch.rand(5, 2)
    permuted, sorted_indices = npu.npu_moe_token_permute(tokens, INDICES)
    restored = npu.npu_moe_token_unpermute(permuted, sorted_indices, probs, restore_shape=(5, 4))
    torch.testing.assert_close(restored, tokens * probs.sum(1, keepdim=True))


def test_permute_and_unpermute_gradients_follow_the_gather_and_the_sum(npu):
    tokens = torch.randn(5, 4, requires_grad=True)
    permuted, sorted_indices = npu.npu_moe_token_permute(tokens, INDICES)
    upstream = torch.randn(10, 4)
    (d_tokens,) = torch.autograd.grad((permuted * upstream).sum(), tokens)
    s = sorted_indices.tolist()
    torch.testing.assert_close(d_tokens, torch.stack([upstream[s[2 * t]] + upstream[s[2 * t + 1]] for t in range(5)]))

    rows, probs = torch.randn(10, 4, requires_grad=True), torch.rand(5, 2, requires_grad=True)
    upstream = torch.randn(5, 4)
    out = npu.npu_moe_token_unpermute(rows, sorted_indices, probs)
    d_rows, d_probs = torch.autograd.grad((out * upstream).sum(), (rows, probs))
    for t in range(5):
        for j in range(2):
            torch.testing.assert_close(d_rows[s[2 * t + j]], probs[t, j].detach() * upstream[t])
            torch.testing.assert_close(d_probs[t, j], rows[s[2 * t + j]].detach() @ upstream[t])


def test_permute_is_exact_and_unpermute_one_rounding_in_bf16(npu):
    tokens, probs = torch.randn(5, 8, dtype=torch.bfloat16), torch.rand(5, 2, dtype=torch.bfloat16)
    permuted, sorted_indices = npu.npu_moe_token_permute(tokens, INDICES)
    assert permuted.dtype == torch.bfloat16 and torch.equal(permuted, loop_permute(tokens, INDICES)[0])
    restored = npu.npu_moe_token_unpermute(permuted, sorted_indices, probs)
    assert restored.dtype == torch.bfloat16
    # float32 sum of bf16 products, then one bf16 rounding (tolerance 2**-8 relative)
    torch.testing.assert_close(restored.double(), tokens.double() * probs.double().sum(1, keepdim=True),
                               rtol=2 ** -8, atol=1e-5)


# ---------------------------------------------------------------- MoE: routing-map form
@pytest.fixture(scope="module")
def moe_utils():
    """megatron's own permute / unpermute, the second reference (imported after adapter, as megatron must be)."""
    import adapter  # noqa: F401

    from megatron.core.transformer.moe import moe_utils

    return moe_utils


# T=6 tokens, E=4 experts, k=2 each; expert 2 gets no token
ROUTING = torch.tensor([[1, 1, 0, 0], [0, 1, 0, 1], [1, 0, 0, 1], [1, 1, 0, 0], [1, 0, 0, 1], [0, 1, 0, 1]],
                       dtype=torch.bool)
# drop_and_pad with capacity 2 (num_out_tokens 6 over E=3): expert 0 has 3 routed tokens, one of them dropped
PADDED_ROUTING = torch.tensor([[1, 0, 1], [1, 1, 0], [0, 1, 0], [1, 0, 1], [0, 0, 0], [0, 0, 0]], dtype=torch.bool)


def test_routing_map_permute_matches_an_explicit_loop_and_megatron(npu, moe_utils):
    tokens, probs = torch.randn(6, 4), torch.rand(6, 4)
    permuted, permuted_probs, sorted_indices = npu.npu_moe_token_permute_with_routing_map(
        tokens, ROUTING, probs=probs, num_out_tokens=12)
    pairs = [(t, e) for e in range(4) for t in range(6) if ROUTING[t, e]]  # expert-major, token-ascending
    assert torch.equal(permuted, torch.stack([tokens[t] for t, _ in pairs]))
    assert torch.equal(permuted_probs, torch.stack([probs[t, e] for t, e in pairs]))
    assert sorted_indices.dtype == torch.int32
    for i in range(12):
        assert torch.equal(permuted[sorted_indices[i]], tokens[i // 2])
    megatron = moe_utils.permute(tokens, ROUTING, probs=probs, num_out_tokens=12)
    assert torch.equal(permuted, megatron[0]) and torch.equal(permuted_probs, megatron[1])
    assert torch.equal(sorted_indices.long(), torch.argsort(megatron[2], stable=True))


@pytest.mark.parametrize("with_probs", [True, False])
def test_routing_map_unpermute_matches_megatron(npu, moe_utils, with_probs):
    tokens, probs, expert_out = torch.randn(6, 4), torch.rand(6, 4), torch.randn(12, 4)
    _, _, sorted_indices = npu.npu_moe_token_permute_with_routing_map(tokens, ROUTING, num_out_tokens=12)
    _, _, megatron_indices = moe_utils.permute(tokens, ROUTING, num_out_tokens=12)[:3]  # 0.17+ appends two
    extra = {"probs": probs, "routing_map": ROUTING} if with_probs else {}
    out = npu.npu_moe_token_unpermute_with_routing_map(expert_out, sorted_indices, tokens.shape, **extra)
    torch.testing.assert_close(out, moe_utils.unpermute(expert_out, megatron_indices, tokens.shape, **extra))


def test_routing_map_drop_and_pad_matches_megatron(npu, moe_utils):
    tokens, probs, expert_out = torch.randn(6, 4), torch.rand(6, 3), torch.randn(6, 4)
    permuted, permuted_probs, slots = npu.npu_moe_token_permute_with_routing_map(
        tokens, PADDED_ROUTING, probs=probs, num_out_tokens=6, drop_and_pad=True)
    assert slots.tolist() == [0, 1, 1, 2, 0, 3]  # per expert, its first capacity=2 tokens (token 3 dropped)
    megatron = moe_utils.permute(tokens, PADDED_ROUTING, probs=probs, num_out_tokens=6, drop_and_pad=True)
    assert torch.equal(permuted, megatron[0]) and torch.equal(permuted_probs, megatron[1])
    assert torch.equal(slots.long(), megatron[2])
    out = npu.npu_moe_token_unpermute_with_routing_map(expert_out, slots, tokens.shape, probs=probs,
                                                       routing_map=PADDED_ROUTING, drop_and_pad=True)
    torch.testing.assert_close(out, moe_utils.unpermute(expert_out, megatron[2], tokens.shape, probs=probs,
                                                        routing_map=PADDED_ROUTING, drop_and_pad=True))


@pytest.mark.parametrize("drop_and_pad", [False, True])
def test_routing_map_unpermute_skips_invalid_slots(npu, drop_and_pad):
    rows = torch.randn(4, 3)
    slots = torch.tensor([2, -1, 0, 1], dtype=torch.int32)
    restore_shape = (4, 3) if drop_and_pad else (2, 3)
    out = npu.npu_moe_token_unpermute_with_routing_map(rows, slots, restore_shape, drop_and_pad=drop_and_pad)
    if drop_and_pad:  # out[s[j]] += rows[j]
        expected = torch.stack([rows[2], rows[3], rows[0], torch.zeros(3)])
    else:  # out[i // 2] += rows[s[i]]
        expected = torch.stack([rows[2], rows[0] + rows[1]])
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("routing, num_out_tokens, drop_and_pad", [(ROUTING, 12, False),
                                                                   (PADDED_ROUTING, 6, True)])
def test_routing_map_gradients_match_megatrons(npu, moe_utils, routing, num_out_tokens, drop_and_pad):
    upstream = torch.randn(6, 4)

    def grads(permute, unpermute):
        tokens = torch.linspace(-1, 1, 24).reshape(6, 4).requires_grad_()
        probs = torch.linspace(0.1, 0.9, 6 * routing.shape[1]).reshape(6, -1).requires_grad_()
        permuted, permuted_probs, indices = permute(tokens, routing, probs=probs, num_out_tokens=num_out_tokens,
                                                    drop_and_pad=drop_and_pad)[:3]  # megatron 0.17+ returns five
        expert_out = 3 * permuted * permuted_probs.unsqueeze(-1)
        out = unpermute(expert_out, indices, tokens.shape, probs=probs, routing_map=routing,
                        drop_and_pad=drop_and_pad)
        return torch.autograd.grad((out * upstream).sum(), (tokens, probs))

    double = grads(npu.npu_moe_token_permute_with_routing_map, npu.npu_moe_token_unpermute_with_routing_map)
    for got, want in zip(double, grads(moe_utils.permute, moe_utils.unpermute)):
        torch.testing.assert_close(got, want)


def test_routing_map_bf16_permute_is_exact_and_unpermute_one_rounding(npu):
    tokens, probs = torch.randn(6, 8, dtype=torch.bfloat16), torch.rand(6, 4, dtype=torch.bfloat16)
    permuted, permuted_probs, sorted_indices = npu.npu_moe_token_permute_with_routing_map(
        tokens, ROUTING, probs=probs, num_out_tokens=12)
    assert permuted.dtype == permuted_probs.dtype == torch.bfloat16
    assert torch.equal(permuted, torch.stack([tokens[t] for e in range(4) for t in range(6) if ROUTING[t, e]]))
    out = npu.npu_moe_token_unpermute_with_routing_map(permuted, sorted_indices, tokens.shape, probs=probs,
                                                       routing_map=ROUTING)
    assert out.dtype == torch.bfloat16
    # float32 sum of bf16 products, one bf16 rounding (tolerance 2**-8 relative)
    expected = tokens.double() * (probs.double() * ROUTING).sum(1, keepdim=True)
    torch.testing.assert_close(out.double(), expected, rtol=2 ** -8, atol=1e-5)


# ---------------------------------------------------------------- MoE: refusals
X, W, CUM = torch.randn(4, 3), torch.randn(2, 3, 5), torch.tensor([1, 4])
SORTED = torch.arange(4, dtype=torch.int32)


def gmm(npu, x=X, w=W, **kwargs):
    return npu.npu_grouped_matmul([x], [w], **{"group_list": CUM, "split_item": 3, "group_type": 0, **kwargs})


REFUSALS = {
    "gmm group_type 1": (lambda n: gmm(n, group_type=1), "group_type 1 .* unsupported"),
    "gmm > 1024 groups": (lambda n: gmm(n, torch.randn(1025, 3), torch.randn(1025, 3, 2),
                                        group_list=torch.arange(1, 1026)), "group_list must hold 1 to 1024"),
    "gmm K >= 65536": (lambda n: gmm(n, torch.zeros(4, 65536), torch.zeros(2, 65536, 1)), "inner dims K=65536"),
    "gmm N >= 65536": (lambda n: gmm(n, w=torch.zeros(2, 3, 65536)), "inner dims .* N=65536"),
    "gmm x transposed": (lambda n: gmm(n, torch.randn(3, 4).t()), "x must not be a transposed view"),
    "gmm int x": (lambda n: gmm(n, X.int()), r"x\[0\] dtype"),
    "gmm mixed dtypes": (lambda n: gmm(n, w=W.half()), "x and weight must share one dtype"),
    "gmm decreasing": (lambda n: gmm(n, w=torch.randn(3, 3, 5), group_list=torch.tensor([3, 2, 4])),
                       "group_list .* non-decreasing"),
    "gmm short of M": (lambda n: gmm(n, group_list=torch.tensor([1, 3])), "group_list .* ending at 4"),
    "gmm counts sum": (lambda n: gmm(n, group_list=torch.tensor([1, 2]), group_list_type=1), "group_list counts"),
    "gmm one count": (lambda n: gmm(n, w=W[:1], group_list=torch.tensor([4]), group_list_type=1),
                      "group_list counts .* more than one"),
    "gmm int32 group_list": (lambda n: gmm(n, group_list=CUM.int()), "group_list must be a 1-D int64"),
    "gmm list + group_type": (lambda n: gmm(n, group_list=[1, 4]), "group_list needs group_type=None"),
    "gmm list as counts": (lambda n: gmm(n, group_list=[1, 3], group_type=None, group_list_type=1),
                           "group_list is always cumulative"),
    "gmm tensor, no group_type": (lambda n: gmm(n, group_type=None), "Tensor group_list needs an explicit group_type"),
    "gmm no group_list": (lambda n: gmm(n, group_list=None), "group_type 0 needs a group_list"),
    "gmm groups != experts": (lambda n: gmm(n, group_list=torch.tensor([0, 1, 4])), "group_list has 3 groups"),
    "gmm split_item": (lambda n: gmm(n, split_item=4), "split_item"),
    "gmm quantised": (lambda n: gmm(n, scale=[torch.ones(2, 5)]), "scale is not modelled"),
    "gmm output_dtype": (lambda n: gmm(n, output_dtype=torch.float16), "output_dtype .* not modelled"),
    "permute padded_mode": (lambda n: n.npu_moe_token_permute(X, INDICES[:4], padded_mode=True), "padded_mode"),
    "permute k > 512": (lambda n: n.npu_moe_token_permute(X, torch.zeros(4, 513, dtype=torch.int64)),
                        "indices top-k 513"),
    "permute index too big": (lambda n: n.npu_moe_token_permute(X, torch.full((4, 1), 16777215)), "indices values"),
    "permute negative index": (lambda n: n.npu_moe_token_permute(X, -torch.ones(4, 1, dtype=torch.int64)),
                               "indices values"),
    "permute float indices": (lambda n: n.npu_moe_token_permute(X, torch.zeros(4, 1)), "indices must be an int32"),
    "permute int tokens": (lambda n: n.npu_moe_token_permute(X.int(), INDICES[:4]), "tokens dtype"),
    "permute rows": (lambda n: n.npu_moe_token_permute(X, INDICES), r"indices must be \[T, k\] or \[T\] with T=4"),
    "permute num_out_tokens": (lambda n: n.npu_moe_token_permute(X, INDICES[:4], num_out_tokens=-9),
                               "num_out_tokens -9"),
    "unpermute padded_mode": (lambda n: n.npu_moe_token_unpermute(X, SORTED, padded_mode=True), "padded_mode"),
    "unpermute int64 indices": (lambda n: n.npu_moe_token_unpermute(X, SORTED.long()), "sorted_indices must be"),
    "unpermute probs shape": (lambda n: n.npu_moe_token_unpermute(X, SORTED, torch.rand(3, 2)),
                              "sorted_indices holds 4 entries"),
    "unpermute restore_shape": (lambda n: n.npu_moe_token_unpermute(X, SORTED, restore_shape=(2, 3)),
                                "restore_shape"),
    "unpermute dropped row": (lambda n: n.npu_moe_token_unpermute(X[:3], SORTED), "sorted_indices points past"),
    "map row count": (lambda n: n.npu_moe_token_permute_with_routing_map(torch.randn(6, 4), ROUTING,
                                                                         num_out_tokens=6), "routing_map row"),
    "map float": (lambda n: n.npu_moe_token_permute_with_routing_map(torch.randn(6, 4), ROUTING.float()),
                  "routing_map must be a bool or int8"),
    "map rows": (lambda n: n.npu_moe_token_permute_with_routing_map(X, ROUTING), r"routing_map must be \[T, E\]"),
    "map probs dtype": (lambda n: n.npu_moe_token_permute_with_routing_map(
        torch.randn(6, 4), ROUTING, probs=torch.rand(6, 4, dtype=torch.bfloat16), num_out_tokens=12),
        "probs dtype"),
    "map num_out_tokens < T": (lambda n: n.npu_moe_token_permute_with_routing_map(
        torch.randn(6, 4), ROUTING, num_out_tokens=5), "num_out_tokens 5 must be at least T=6"),
    "pad without num_out_tokens": (lambda n: n.npu_moe_token_permute_with_routing_map(
        torch.randn(6, 4), PADDED_ROUTING, drop_and_pad=True), "num_out_tokens is needed with drop_and_pad"),
    "pad expert short": (lambda n: n.npu_moe_token_permute_with_routing_map(
        torch.randn(6, 4), PADDED_ROUTING, num_out_tokens=9, drop_and_pad=True),
        "routing_map routes fewer than capacity=3"),
    "map unpermute probs": (lambda n: n.npu_moe_token_unpermute_with_routing_map(
        X, SORTED, (2, 3), probs=torch.rand(2, 4)), "routing_map is needed with probs"),
    "map unpermute restore_shape": (lambda n: n.npu_moe_token_unpermute_with_routing_map(X, SORTED, (2, 4)),
                                    "restore_shape"),
    "map unpermute -2": (lambda n: n.npu_moe_token_unpermute_with_routing_map(
        X, torch.tensor([0, 1, 2, -2], dtype=torch.int32), (2, 3)), "sorted_indices values must be >= -1"),
    "map unpermute length": (lambda n: n.npu_moe_token_unpermute_with_routing_map(X, SORTED[:2], (2, 3)),
                             "sorted_indices must hold one entry per permuted row"),
}
NOT_MODELLED = {"gmm quantised", "gmm output_dtype", "unpermute dropped row", "pad expert short"}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_moe_ops_refuse_what_the_reference_rules_out_naming_the_argument(npu, case):
    call, error = REFUSALS[case]
    with pytest.raises(NotImplementedError if case in NOT_MODELLED else RuntimeError, match=error) as raised:
        call(npu)
    assert (raised.type is NotImplementedError) == (case in NOT_MODELLED)

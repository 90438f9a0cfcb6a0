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
    q_lens, kv_lens = [2, 2, 2], [3, 1, 4]
    q, k, v = torch.randn(6, 2, 8), torch.randn(8, 2, 8), torch.randn(8, 2, 8)
    extra = {} if mask is None else {"atten_mask": mask, "sparse_mode": sparse_mode}
    packed = npu.npu_fusion_attention(q, k, v, 2, "TND", actual_seq_qlen=[2, 4, 6], actual_seq_kvlen=[3, 4, 8],
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
])
def test_rotary_refuses_what_the_kernel_rejects(npu, x, r, mode, error):
    with pytest.raises(RuntimeError, match=error):
        npu.npu_rotary_mul(x, r, r, rotary_mode=mode)


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

"""Ring-attention (context-parallel) kernels on the npu provider, against the torch_npu double.

Two layers, each checked against plain softmax attention written here in float64 (never the double's own
code): the double's ``npu_fusion_attention_grad`` and ``npu_ring_attention_update`` as
shared/reference/torch_npu.md specifies them, refusals included; and the provider's ``attention_with_lse``,
``attention_grad_from_lse`` and ``merge_with_lse`` run the way a ring does (queries and keys cut into two
blocks each, causal blocks on the diagonal), whose merged outputs and summed block gradients must equal full
attention's and its autograd gradients.
"""

from __future__ import annotations

import pytest
import torch

COMPRESSED = torch.triu(torch.ones(2048, 2048), 1).bool()
SCALE = 0.3
B, NQ, S, D = 2, 4, 8, 16
TIGHT = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture
def npu(torch_npu_double):
    torch.manual_seed(0)
    return torch_npu_double


def qkv(nkv: int, seq: int = S, head_dim: int = D, requires_grad: bool = False):
    q = torch.randn(B, NQ, seq, head_dim, requires_grad=requires_grad)
    k, v = (torch.randn(B, nkv, seq, head_dim, requires_grad=requires_grad) for _ in range(2))
    return q, k, v


def scores64(q, k, scale, causal):
    """scale * q k^T in float64, K repeated to q's heads (query head h reads KV head h // group), causal
    top-left (key j > row i masked with -inf)."""
    k = k.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = scale * q.double() @ k.transpose(-2, -1)
    if causal:
        sq, sk = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(sq, sk, dtype=torch.bool).triu(1), float("-inf"))
    return scores


def attention64(q, k, v, scale, causal=False):
    """(out, lse) of plain softmax attention in float64; differentiable."""
    scores = scores64(q, k, scale, causal)
    v = v.double().repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    return torch.softmax(scores, dim=-1) @ v, torch.logsumexp(scores, dim=-1)


def grads64(q, k, v, dout, scale, causal):
    """Autograd's (dq, dk, dv) of sum(attention64 * dout), from float64 leaves."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    return torch.autograd.grad((attention64(*leaves, scale, causal)[0] * dout.double()).sum(), leaves)


def stat(rows):
    return rows.float().unsqueeze(-1).expand(*rows.shape, 8).contiguous()


# ---------------------------------------------------------------- the double: npu_fusion_attention_grad
@pytest.mark.parametrize("nkv", [4, 2, 1])
@pytest.mark.parametrize("causal", [False, True])
def test_fa_grad_with_the_forward_statistics_is_the_autograd_gradient(npu, nkv, causal):
    q, k, v = qkv(nkv, requires_grad=True)
    mask = dict(atten_mask=COMPRESSED, sparse_mode=2) if causal else {}
    out, row_max, row_sum = npu.npu_fusion_attention(q, k, v, NQ, "BNSD", scale=SCALE, **mask)[:3]
    dy = torch.randn_like(out)
    dq, dk, dv, dpse, dsink = npu.npu_fusion_attention_grad(
        q, k, v, dy, NQ, "BNSD", softmax_max=row_max, softmax_sum=row_sum, attention_in=out.detach(),
        scale_value=SCALE, **mask)
    expected = grads64(q, k, v, dy, SCALE, causal)
    for got, want in zip((dq, dk, dv), expected):
        assert got.dtype == torch.float32 and got.shape == want.shape
        torch.testing.assert_close(got.double(), want, **TIGHT)
    assert dpse.numel() == 0 and dsink.numel() == 0
    assert npu.CALLS["npu_fusion_attention_grad"] == 1


def test_fa_grad_takes_lse_as_max_with_unit_sum(npu):
    q, k, v = qkv(2)
    out, row_max, row_sum = npu.npu_fusion_attention(q, k, v, NQ, "BNSD", scale=SCALE)[:3]
    dy = torch.randn_like(out)
    common = dict(attention_in=out, scale_value=SCALE)
    given = npu.npu_fusion_attention_grad(q, k, v, dy, NQ, "BNSD", softmax_max=row_max, softmax_sum=row_sum, **common)
    lse = row_max[..., 0] + row_sum[..., 0].log()
    folded = npu.npu_fusion_attention_grad(q, k, v, dy, NQ, "BNSD", softmax_max=stat(lse),
                                           softmax_sum=stat(torch.ones_like(lse)), **common)
    for got, want in zip(folded[:3], given[:3]):
        torch.testing.assert_close(got, want, **TIGHT)


def test_fa_grad_sbh_layout_agrees_with_bnsd(npu):
    q, k, v = qkv(2)
    out, row_max, row_sum = npu.npu_fusion_attention(q, k, v, NQ, "BNSD", scale=SCALE)[:3]
    dy = torch.randn_like(out)
    stats = dict(softmax_max=row_max, softmax_sum=row_sum, scale_value=SCALE)
    bnsd = npu.npu_fusion_attention_grad(q, k, v, dy, NQ, "BNSD", attention_in=out, **stats)
    sbh = [t.permute(2, 0, 1, 3).reshape(S, B, -1) for t in (q, k, v, dy, out)]
    got = npu.npu_fusion_attention_grad(*sbh[:4], NQ, "SBH", attention_in=sbh[4], **stats)
    for g, want in zip(got[:3], bnsd[:3]):
        torch.testing.assert_close(g, want.permute(2, 0, 1, 3).reshape(S, B, -1), **TIGHT)


def _grad_call(npu, change):
    q, k, v = qkv(2)
    out, row_max, row_sum = npu.npu_fusion_attention(q, k, v, NQ, "BNSD", scale=SCALE)[:3]
    args = dict(query=q, key=k, value=v, dy=torch.randn_like(out), head_num=NQ, input_layout="BNSD",
                softmax_max=row_max, softmax_sum=row_sum, attention_in=out, scale_value=SCALE)
    args.update(change(args))
    return npu.npu_fusion_attention_grad(**args)


@pytest.mark.parametrize("change, error, match", [
    (lambda a: dict(query=a["query"].double()), RuntimeError, "float16, bfloat16 or float32"),
    (lambda a: dict(dy=a["dy"].half()), RuntimeError, "share a dtype"),
    (lambda a: dict(dy=a["dy"][:, :, :4]), RuntimeError, "dy must be shaped"),
    (lambda a: dict(attention_in=a["attention_in"].half()), RuntimeError, "attention_in"),
    (lambda a: dict(softmax_max=a["softmax_max"][..., 0]), RuntimeError, r"softmax_max must be \[2, 4, 8, 8\]"),
    (lambda a: dict(softmax_sum=a["softmax_sum"].half()), RuntimeError, "softmax_sum must be a float32"),
    (lambda a: dict(head_num=3), RuntimeError, "head_num 3"),
    (lambda a: dict(input_layout="NSD"), RuntimeError, "input_layout"),
    (lambda a: dict(atten_mask=torch.ones(8, 8).triu(1).bool(), sparse_mode=2), RuntimeError, "compressed"),
    (lambda a: dict(actual_seq_qlen=[8]), RuntimeError, "TND only"),
    (lambda a: dict(softmax_max=None), NotImplementedError, "softmax_max is needed"),
    (lambda a: dict(attention_in=None), NotImplementedError, "attention_in is needed"),
    (lambda a: dict(keep_prob=0.9), NotImplementedError, "keep_prob"),
    (lambda a: dict(input_layout="TND"), NotImplementedError, "TND"),
    (lambda a: dict(pse=torch.zeros(1)), NotImplementedError, "pse"),
])
def test_fa_grad_refuses_what_the_kernel_rejects_or_the_double_does_not_model(npu, change, error, match):
    with pytest.raises(error, match=match):
        _grad_call(npu, change)
    assert npu.CALLS["npu_fusion_attention_grad"] == 1  # refused calls are counted too


def test_fa_grad_keyword_is_scale_value_not_scale(npu):
    with pytest.raises(TypeError, match="scale"):
        _grad_call(npu, lambda a: dict(scale=a.pop("scale_value")))


# ---------------------------------------------------------------- the double: npu_ring_attention_update
def partial64(q, k, v, scale):
    """(out, row max, unnormalised row sum) of attention over these keys only, in float64."""
    scores = scores64(q, k, scale, causal=False)
    row_max = scores.amax(dim=-1)
    out, _ = attention64(q, k, v, scale)
    return out, row_max, torch.exp(scores - row_max[..., None]).sum(dim=-1)


def to_sbh(t):
    return t.permute(2, 0, 1, 3).reshape(t.shape[2], t.shape[0], -1)


def test_ring_update_of_two_key_blocks_is_full_attention_sbh(npu):
    q, k, v = qkv(2)
    halves = [partial64(q, k[:, :, part], v[:, :, part], SCALE) for part in (slice(0, 3), slice(3, S))]
    (p_out, p_max, p_sum), (c_out, c_max, c_sum) = halves
    out, new_max, new_sum = npu.npu_ring_attention_update(
        to_sbh(p_out).float(), stat(p_max), stat(p_sum), to_sbh(c_out).float(), stat(c_max), stat(c_sum))
    full_out, full_lse = attention64(q, k, v, SCALE)
    torch.testing.assert_close(out.double(), to_sbh(full_out), **TIGHT)
    assert new_max.shape == new_sum.shape == (B, NQ, S, 8) and new_max.dtype == torch.float32
    assert bool((new_max == new_max[..., :1]).all())  # the 8 slots are equal
    torch.testing.assert_close(new_max[..., 0].double(), torch.maximum(p_max, c_max), **TIGHT)
    torch.testing.assert_close((new_max[..., 0] + new_sum[..., 0].log()).double(), full_lse, **TIGHT)
    assert not out.requires_grad and npu.CALLS["npu_ring_attention_update"] == 1


def test_ring_update_tnd_with_true_tnd_statistics(npu):
    q, k, v = qkv(1, head_dim=64)
    halves = [partial64(q, k[:, :, part], v[:, :, part], SCALE) for part in (slice(0, 5), slice(5, S))]

    def tnd(t):  # [B, N, S, ...] -> [B*S, N, ...]: batch rows packed one after the other
        return t.transpose(1, 2).flatten(0, 1)

    args = [x for out, m, s in halves for x in (tnd(out).float(), stat(tnd(m)), stat(tnd(s)))]
    seqlen = torch.tensor([0, S, 2 * S], dtype=torch.int64)
    out = npu.npu_ring_attention_update(*args, actual_seq_qlen=seqlen, input_layout="TND",
                                        input_softmax_layout="TND")[0]
    torch.testing.assert_close(out.double(), tnd(attention64(q, k, v, SCALE)[0]), **TIGHT)


def _ring_call(npu, change, head_dim=D, layout="SBH"):
    out = torch.randn(S, B, NQ * head_dim) if layout == "SBH" else torch.randn(B * S, NQ, head_dim)
    rows = (B, NQ, S) if layout == "SBH" else (B * S, NQ)
    args = dict(prev_out=out, prev_max=stat(torch.randn(rows)), prev_sum=stat(torch.rand(rows) + 1),
                cur_out=out.clone(), cur_max=stat(torch.randn(rows)), cur_sum=stat(torch.rand(rows) + 1),
                input_layout=layout)
    if layout == "TND":
        args.update(actual_seq_qlen=torch.tensor([0, S, 2 * S]), input_softmax_layout="TND")
    args.update(change(args))
    return npu.npu_ring_attention_update(**args)


@pytest.mark.parametrize("change, layout, head_dim, error, match", [
    (lambda a: dict(prev_out=a["prev_out"].double(), cur_out=a["cur_out"].double()), "SBH", D, RuntimeError,
     "float16, bfloat16 or float32"),
    (lambda a: dict(cur_out=a["cur_out"].half()), "SBH", D, RuntimeError, "cur_out must match"),
    (lambda a: dict(cur_max=a["cur_max"].half()), "SBH", D, RuntimeError, "cur_max must be a float32"),
    (lambda a: dict(prev_sum=a["prev_sum"][..., :4]), "SBH", D, RuntimeError, r"prev_sum must be \[2, 4, 8, 8\]"),
    (lambda a: dict(input_layout="BNSD"), "SBH", D, RuntimeError, "input_layout"),
    (lambda a: dict(actual_seq_qlen=torch.tensor([0, S])), "SBH", D, RuntimeError, "TND only"),
    (lambda a: {}, "TND", 32, RuntimeError, "multiple of 64"),
    (lambda a: dict(actual_seq_qlen=torch.tensor([S, 2 * S])), "TND", 64, RuntimeError, "leading 0"),
    (lambda a: dict(actual_seq_qlen=[0, S, 2 * S]), "TND", 64, RuntimeError, "int64 Tensor"),
    (lambda a: dict(input_softmax_layout=""), "TND", 64, NotImplementedError, "input_softmax_layout"),
])
def test_ring_update_refuses_what_the_kernel_rejects(npu, change, layout, head_dim, error, match):
    with pytest.raises(error, match=match):
        _ring_call(npu, change, head_dim, layout)
    assert npu.CALLS["npu_ring_attention_update"] == 1


def test_ring_update_accepts_the_valid_calls_the_refusal_cases_start_from(npu):
    _ring_call(npu, lambda a: {})
    _ring_call(npu, lambda a: {}, head_dim=64, layout="TND")


# ---------------------------------------------------------------- the provider, run as a ring
def ring_blocks(causal: bool):
    """(query half, key half, causal) of each block a two-rank ring computes: below the diagonal in full,
    on it causal, above it nothing (causal); every pair without causal."""
    return [(i, j, causal and i == j) for i in range(2) for j in range(2) if not (causal and j > i)]


def ring_forward(kernels, q, k, v, causal):
    """Each query half's (out, lse), merged over its blocks with merge_with_lse."""
    qs, ks, vs = (t.chunk(2, dim=2) for t in (q, k, v))
    merged = {}
    for i, j, block_causal in ring_blocks(causal):
        out, lse, _ = kernels.attention_with_lse(qs[i], ks[j], vs[j], scale=SCALE, causal=block_causal)
        merged[i] = (out, lse) if i not in merged else kernels.merge_with_lse(*merged[i], out, lse)
    return [merged[i] for i in range(2)]


def ring_backward(kernels, dout, q, k, v, merged, causal):
    """dq, dk, dv summed over the blocks, each block fed its rows' GLOBAL out and lse."""
    qs, ks, vs, douts = (list(t.chunk(2, dim=2)) for t in (q, k, v, dout))
    dq, dk, dv = ([torch.zeros_like(t) for t in parts] for parts in (qs, ks, vs))
    for i, j, block_causal in ring_blocks(causal):
        out, lse = merged[i]
        gq, gk, gv = kernels.attention_grad_from_lse(douts[i], qs[i], ks[j], vs[j], out, lse, scale=SCALE,
                                                     causal=block_causal)
        dq[i], dk[j], dv[j] = dq[i] + gq, dk[j] + gk, dv[j] + gv
    return [torch.cat(parts, dim=2) for parts in (dq, dk, dv)]


@pytest.mark.parametrize("nkv", [2, 1])
@pytest.mark.parametrize("causal", [False, True])
def test_ring_of_npu_blocks_equals_full_attention_and_its_gradients(npu_kernels, torch_npu_double, nkv, causal):
    q, k, v = qkv(nkv)
    merged = ring_forward(npu_kernels, q, k, v, causal)
    out, lse = (torch.cat(parts, dim=2) for parts in zip(*merged))
    full_out, full_lse = attention64(q, k, v, SCALE, causal)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32 and lse.shape == (B, NQ, S)
    torch.testing.assert_close(out.double(), full_out, **TIGHT)
    torch.testing.assert_close(lse.double(), full_lse, **TIGHT)

    dout = torch.randn(B, NQ, S, D)
    grads = ring_backward(npu_kernels, dout, q, k, v, merged, causal)
    expected = grads64(q, k, v, dout, SCALE, causal)
    for got, want in zip(grads, expected):
        assert got.shape == want.shape
        torch.testing.assert_close(got.double(), want, **TIGHT)

    blocks = len(ring_blocks(causal))
    assert torch_npu_double.CALLS["npu_fusion_attention"] == blocks
    assert torch_npu_double.CALLS["npu_fusion_attention_grad"] == blocks
    assert torch_npu_double.CALLS["npu_ring_attention_update"] == blocks - 2  # one merge per extra block


def test_attention_with_lse_is_the_blocks_logsumexp(npu_kernels):
    q, k, v = qkv(2)
    for causal in (False, True):
        out, lse, saved = npu_kernels.attention_with_lse(q, k, v, scale=SCALE, causal=causal)
        assert saved is None
        want_out, want_lse = attention64(q, k, v, SCALE, causal)
        torch.testing.assert_close(out.double(), want_out, **TIGHT)
        torch.testing.assert_close(lse.double(), want_lse, **TIGHT)


def test_merge_with_lse_matches_the_torch_formula_and_leaves_its_inputs(npu_kernels):
    out, block_out = torch.randn(B, NQ, S, D), torch.randn(B, NQ, S, D)
    lse, block_lse = torch.randn(B, NQ, S), torch.randn(B, NQ, S)
    kept = [t.clone() for t in (out, lse, block_out, block_lse)]
    merged, merged_lse = npu_kernels.merge_with_lse(out, lse, block_out, block_lse)
    want_lse = torch.logaddexp(lse, block_lse)
    want = out * (lse - want_lse).exp()[..., None] + block_out * (block_lse - want_lse).exp()[..., None]
    torch.testing.assert_close(merged, want, **TIGHT)
    torch.testing.assert_close(merged_lse, want_lse, **TIGHT)
    assert merged.is_contiguous() and merged.shape == out.shape
    for before, after in zip(kept, (out, lse, block_out, block_lse)):
        assert torch.equal(before, after)


def test_low_precision_blocks_take_a_float32_global_out_and_return_the_inputs_dtype(npu_kernels):
    q, k, v = (t.bfloat16() for t in qkv(2))
    out, lse, _ = npu_kernels.attention_with_lse(q, k, v, scale=SCALE, causal=True)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    grads = npu_kernels.attention_grad_from_lse(torch.randn(B, NQ, S, D), q, k, v, out.float(), lse,
                                                scale=SCALE, causal=True)
    assert [g.dtype for g in grads] == [torch.bfloat16] * 3
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


def test_too_many_query_heads_are_refused_before_the_kernel(npu_kernels, torch_npu_double):
    from adapter.kernels import UnsupportedKernelSetting

    q, k = torch.randn(1, 6, 4, 8), torch.randn(1, 4, 4, 8)
    with pytest.raises(UnsupportedKernelSetting, match="whole multiple"):
        npu_kernels.attention_with_lse(q, k, k, scale=SCALE, causal=False)
    with pytest.raises(UnsupportedKernelSetting, match="whole multiple"):
        npu_kernels.attention_grad_from_lse(q, q, k, k, q, q[..., 0], scale=SCALE, causal=False)
    assert torch_npu_double.CALLS["npu_fusion_attention"] == torch_npu_double.CALLS["npu_fusion_attention_grad"] == 0

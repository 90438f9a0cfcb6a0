"""The ``npu`` kernel provider: torch_npu's fused operators, called as ../shared/reference/torch_npu.md
documents them.

Only the argument building lives here; it runs on CPU tensors against the tests' torch_npu double as well
as on an Ascend NPU. Points the reference insists on: ``npu_fusion_attention`` defaults ``scale`` to 1.0
(always passed), its masks are True = masked out, causal modes take the compressed 2048x2048 mask, packed
lengths are cumulative without the leading 0, and GQA takes K/V unexpanded.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import torch_npu

from adapter.kernels import UnsupportedKernelSetting, cross_entropy, torch_provider
from adapter.kernels import npu_moe_permute as moe_permute  # noqa: F401 - the provider's moe_permute
from adapter.kernels.provider import complete

NAME = "npu"

UNBOUNDED = 2147483647  # npu_fusion_attention's "no limit" for pre/next tokens
SPARSE_BAND = 0  # full atten_mask, optionally band-limited
SPARSE_CAUSAL_BOTTOM_RIGHT = 3
SPARSE_BAND_BOTTOM_RIGHT = 4
MAX_QUERY_HEADS = 256
MAX_ROTARY_DIM = 896


@functools.lru_cache(maxsize=None)
def compressed_causal_mask(device: torch.device) -> torch.Tensor:
    """The fixed 2048x2048 upper-triangular mask the compressed sparse modes (2, 3, 4) take."""
    return torch.triu(torch.ones(2048, 2048, dtype=torch.bool, device=device), diagonal=1)


def rms_norm(x, weight, eps):
    return torch_npu.npu_rms_norm(x, weight, epsilon=eps)[0]


def layer_norm(x, weight, bias, eps):
    # torch_npu runs aten's layer_norm as its fused LayerNorm kernel
    return F.layer_norm(x, weight.shape, weight, bias, eps)


def bias_swiglu(input, bias, fp8_input_store=False, cpu_offload_input=False):
    """megatron's bias_swiglu_impl on npu_swiglu (which gates the first half, as megatron does)."""
    if fp8_input_store:
        raise UnsupportedKernelSetting("activation_func_fp8_input_store=True has no NPU kernel; set it False")
    if bias is not None:
        input = input + bias
    return torch_npu.npu_swiglu(input, dim=-1)


def _check_heads(nq: int, nkv: int) -> None:
    if nq > MAX_QUERY_HEADS or nq % nkv:
        raise UnsupportedKernelSetting(
            f"{nq} query heads over {nkv} key/value heads per rank: npu_fusion_attention needs at most "
            f"{MAX_QUERY_HEADS} query heads per rank, a whole multiple of the key/value heads; raise "
            "tensor_model_parallel_size or fix num_query_groups")


MAX_HEAD_DIM = 768


def _head_dims(q, k, v):
    """q and k at a head size npu_fusion_attention takes with v's. The op needs Dq == Dk >= Dv, each at most
    768 (torch_npu 2.14 docs): multi-latent attention's wider query/key heads (qk_head_dim +
    qk_pos_emb_head_dim) over narrower value heads go in as they are. A value head wider than the query/key
    one gets q and k zero-padded to it, which leaves every score q k^T unchanged (the pads' gradients are
    dropped by autograd's slice)."""
    dk, dv = q.shape[-1], v.shape[-1]
    if max(dk, dv) > MAX_HEAD_DIM:
        raise UnsupportedKernelSetting(
            f"attention head sizes {dk} (query/key) and {dv} (value): npu_fusion_attention takes at most "
            f"{MAX_HEAD_DIM}; lower kv_channels (or qk_head_dim + qk_pos_emb_head_dim, v_head_dim)")
    if dv <= dk:
        return q, k
    return F.pad(q, (0, dv - dk)), F.pad(k, (0, dv - dk))


def _window_tokens(window) -> tuple[int, int]:
    left, right = window
    return (UNBOUNDED if left < 0 else left), (UNBOUNDED if right < 0 else right)


def attention(q, k, v, *, scale, causal, mask, window, dropout_p, cu_seqlens_q=None, cu_seqlens_kv=None):
    nq = q.shape[-2]
    _check_heads(nq, k.shape[-2])
    q, k = _head_dims(q, k, v)
    options = dict(scale=scale, keep_prob=1.0 - dropout_p)
    if cu_seqlens_q is not None:
        if causal:
            options.update(atten_mask=compressed_causal_mask(q.device), sparse_mode=SPARSE_CAUSAL_BOTTOM_RIGHT)
        out = torch_npu.npu_fusion_attention(
            q, k, v, nq, "TND", actual_seq_qlen=cu_seqlens_q[1:].tolist(),
            actual_seq_kvlen=cu_seqlens_kv[1:].tolist(), **options)[0]
        return out.reshape(out.shape[0], -1)

    sq, b = q.shape[:2]
    if window is not None:
        if mask is not None:
            raise UnsupportedKernelSetting(f"sliding window {window} with an attention mask: npu_fusion_attention "
                                       "takes one or the other; drop the padding mask or window_size")
        if causal:
            window = (window[0], 0 if window[1] < 0 else min(window[1], 0))
        pre, nxt = _window_tokens(window)
        options.update(atten_mask=compressed_causal_mask(q.device), sparse_mode=SPARSE_BAND_BOTTOM_RIGHT,
                       pre_tockens=pre, next_tockens=nxt)
    elif mask is not None:
        if causal:
            sk = k.shape[0]
            mask = mask | torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu_(sk - sq + 1)
        options.update(atten_mask=mask, sparse_mode=SPARSE_BAND)
    elif causal:
        options.update(atten_mask=compressed_causal_mask(q.device), sparse_mode=SPARSE_CAUSAL_BOTTOM_RIGHT)
    out = torch_npu.npu_fusion_attention(
        q.reshape(sq, b, -1), k.reshape(k.shape[0], b, -1), v.reshape(v.shape[0], b, -1), nq, "SBH",
        **options)[0]
    return out


SPARSE_CAUSAL_TOP_LEFT = 2
STAT_SLOTS = 8  # softmax_max / softmax_sum repeat each row's value over a trailing dim of 8


def _block_mask(causal: bool, device) -> dict:
    """atten_mask / sparse_mode for one ring block: none, or causal top-left (mode 2, the compressed mask)."""
    if not causal:
        return {}
    return dict(atten_mask=compressed_causal_mask(device), sparse_mode=SPARSE_CAUSAL_TOP_LEFT)


def _stat(rows: torch.Tensor) -> torch.Tensor:
    """A per-row float32 statistic [b, n, s] in the kernel's [b, n, s, 8] layout."""
    return rows.float().unsqueeze(-1).expand(*rows.shape, STAT_SLOTS).contiguous()


def attention_with_lse(q, k, v, *, scale, causal):
    """One ring-attention block on npu_fusion_attention (BNSD, GQA with K/V unexpanded): out [b, nq, sq, d]
    in q's dtype and lse [b, nq, sq] float32 over the visible keys. The kernel hands back the row max and
    the unnormalised row sum of exp(score - max) rather than the lse, so lse = max + log(sum) from slot 0.
    causal is top-left aligned (sparse_mode 2), which for sq == sk is the diagonal block's mask. The
    backward needs nothing more from the forward (``saved`` None): no dropout, so no seed or offset."""
    _check_heads(q.shape[1], k.shape[1])
    out, row_max, row_sum = torch_npu.npu_fusion_attention(
        q, k, v, q.shape[1], "BNSD", scale=scale, keep_prob=1.0, **_block_mask(causal, q.device))[:3]
    return out, row_max[..., 0] + torch.log(row_sum[..., 0]), None


def attention_grad_from_lse(dout, q, k, v, out, lse, *, scale, causal, saved=None):
    """Gradients (dq, dk, dv) of one block on npu_fusion_attention_grad, given the GLOBAL out and lse of the
    rows: the kernel rebuilds P = exp(scale q k^T - softmax_max) / softmax_sum and D = rowsum(dout * out)
    from what it is fed, so softmax_max = lse and softmax_sum = 1 give the globally normalised P of this
    block's keys (MindSpeed feeds the final merged max/sum; the two are the same P). dout and out go in in
    q's dtype, as the kernel takes them; dq [b, nq, sq, d], dk / dv with k / v's head count, in q's dtype."""
    _check_heads(q.shape[1], k.shape[1])
    dq, dk, dv = torch_npu.npu_fusion_attention_grad(
        q, k, v, dout.to(q.dtype), q.shape[1], "BNSD", softmax_max=_stat(lse),
        softmax_sum=_stat(torch.ones_like(lse, dtype=torch.float32)), attention_in=out.to(q.dtype),
        scale_value=scale, keep_prob=1.0, **_block_mask(causal, q.device))[:3]
    return dq, dk, dv


def merge_with_lse(out, lse, block_out, block_lse):
    """Merges a block's partial attention into the running result on npu_ring_attention_update.

    Contract: out and block_out [b, n, s, d] in one dtype, over disjoint key sets of the same query rows;
    lse and block_lse [b, n, s] float32 (logsumexp of the scaled scores over each side's keys). Returns new
    tensors (out' [b, n, s, d] in out's dtype, lse' [b, n, s] float32) with
    lse' = logaddexp(lse, block_lse) and out' = out * exp(lse - lse') + block_out * exp(block_lse - lse');
    the ratios are applied in out's dtype (the op casts them). Neither input is modified; no autograd (the
    op has no backward node). A row with lse = -inf on both sides gives NaN. The op takes SBH outputs and
    [b, n, s, 8] statistics, so out is passed as SBH (a copy each way) with max = lse and sum = 1."""
    b, n, s, d = out.shape
    ones = _stat(torch.ones_like(lse, dtype=torch.float32))
    merged, row_max, row_sum = torch_npu.npu_ring_attention_update(
        _bnsd_to_sbh(out), _stat(lse), ones, _bnsd_to_sbh(block_out.to(out.dtype)), _stat(block_lse), ones,
        input_layout="SBH")
    return merged.view(s, b, n, d).permute(1, 2, 0, 3).contiguous(), row_max[..., 0] + torch.log(row_sum[..., 0])


def _bnsd_to_sbh(t: torch.Tensor) -> torch.Tensor:
    b, n, s, d = t.shape
    return t.permute(2, 0, 1, 3).reshape(s, b, n * d)


def _check_rotary_dim(rot: int) -> None:
    if rot % 2 or rot >= MAX_ROTARY_DIM:
        raise UnsupportedKernelSetting(f"rotary dimension {rot}: npu_rotary_mul needs an even dimension below "
                                   f"{MAX_ROTARY_DIM}; set apply_rope_fusion=False")


def rope(t, freqs, transpose_output_memory: bool = False, interleaved: bool = False):
    """RoPE on t [s, b, h, d] (SBND for npu_rotary_mul) with angles freqs [s, 1, 1, d_rot]."""
    rot = freqs.shape[-1]
    _check_rotary_dim(rot)
    cos, sin = torch.cos(freqs).to(t.dtype), torch.sin(freqs).to(t.dtype)
    rotated = torch_npu.npu_rotary_mul(t[..., :rot], cos, sin,
                                       rotary_mode="interleave" if interleaved else "half")
    if rot == t.shape[-1]:
        return rotated
    return torch.cat((rotated, t[..., rot:]), dim=-1)


def rope_thd(t, cu_seqlens, freqs, cp_size: int = 1, cp_rank: int = 0):
    """RoPE on packed t [t, h, d], laid out as SBND with b = 1; positions restart at each sequence."""
    torch_provider.check_rope_thd(cp_size)
    angles = freqs[torch_provider.packed_positions(cu_seqlens, t.shape[0])]
    return rope(t.unsqueeze(1), angles).squeeze(1)


SOFTMAX_MIN, SOFTMAX_MAX, SOFTMAX_MULTIPLE = 32, 4096, 32


def softmax_fusable(self, mask, b, np, sq, sk) -> bool:
    """FusedScaleMaskSoftmax.is_kernel_available for npu_scaled_masked_softmax: fp16/bf16 scores whose
    last two dims lie in [32, 4096] in multiples of 32, and no sliding window (megatron's fused path
    would silently drop it)."""
    return bool(
        self.scaled_masked_softmax_fusion and self.input_in_float16 and self.window_size is None
        and all(SOFTMAX_MIN <= n <= SOFTMAX_MAX and n % SOFTMAX_MULTIPLE == 0 for n in (sq, sk)))


@functools.lru_cache(maxsize=8)
def _fixed_mask(sq: int, sk: int, causal: bool, device: torch.device) -> torch.Tensor:
    mask = torch.zeros(1, 1, sq, sk, dtype=torch.bool, device=device)
    return mask | torch.ones(sq, sk, dtype=torch.bool, device=device).triu_(1) if causal else mask


def scaled_masked_softmax(self, input, mask):
    """FusedScaleMaskSoftmax.forward_fused_softmax on npu_scaled_masked_softmax (scale, then mask, then
    softmax; causal builds its own mask, as megatron's fused kernel does)."""
    b, np, sq, sk = input.shape
    scale = 1.0 if self.scale is None else self.scale
    if self.attn_mask_type.name == "causal":
        if sq != sk:
            raise UnsupportedKernelSetting(f"causal softmax over {sq} queries and {sk} keys: the causal mask "
                                       "is for self attention (sq == sk)")
        mask = _fixed_mask(sq, sk, True, input.device)
    elif mask is None:
        mask = _fixed_mask(sq, sk, False, input.device)
    return torch_npu.npu_scaled_masked_softmax(input, mask, scale, False)


MAX_CROSS_ENTROPY_ROWS = 200_000  # npu_cross_entropy_loss's documented limit on N


def vocab_parallel_cross_entropy(vocab_parallel_logits, target, tp_group):
    """npu_cross_entropy_loss where one rank holds the whole vocabulary (and the kernel takes the token
    count); across a split vocabulary the loss needs the all-reduces of the torch version. Logits go in
    as float32, as megatron's own cross entropy computes, so the loss keeps megatron's precision."""
    if (tp_group is not None and tp_group.size() > 1) or target.numel() > MAX_CROSS_ENTROPY_ROWS:
        return cross_entropy.vocab_parallel_cross_entropy(vocab_parallel_logits, target, tp_group)
    loss = torch_npu.npu_cross_entropy_loss(
        vocab_parallel_logits.reshape(-1, vocab_parallel_logits.shape[-1]).float(), target.reshape(-1),
        reduction="none")[0]
    return loss.view(target.shape)


def _group_ends(tokens_per_expert, device) -> torch.Tensor:
    """npu_grouped_matmul's group_list: cumulative row ends, int64 (group_list_type 0), summed on the
    device when the counts are a tensor already."""
    counts = tokens_per_expert if torch.is_tensor(tokens_per_expert) else torch.tensor(tokens_per_expert)
    return counts.to(device=device, dtype=torch.int64).cumsum(0)


class _GroupedMatmul(torch.autograd.Function):
    """``npu_grouped_matmul`` has no backward node in torch_npu, so the gradients are grouped matmuls too:
    dx = dy @ w_i per group (split M), dw_i = x_i^T dy_i (split K, group_type 2). The stacked weight
    [E, out, in] goes in as the transposed view [E, in, out] the op reads in place, no copy."""

    @staticmethod
    def forward(ctx, x, ends, weight):
        ctx.save_for_backward(x, ends, weight)
        return torch_npu.npu_grouped_matmul([x], [weight.transpose(1, 2)], group_list=ends, split_item=3,
                                            group_type=0, group_list_type=0)[0]

    @staticmethod
    def backward(ctx, dy):
        x, ends, weight = ctx.saved_tensors
        dy = dy.contiguous()
        dx = torch_npu.npu_grouped_matmul([dy], [weight], group_list=ends, split_item=3,
                                          group_type=0, group_list_type=0)[0]
        dw = torch_npu.npu_grouped_matmul([x.t()], [dy], group_list=ends, split_item=3, group_type=2,
                                          group_list_type=0)[0]  # [E, in, out]
        return dx, None, dw.transpose(1, 2)


def grouped_mm(x, weight, tokens_per_expert):
    """The experts' GEMMs in one ``npu_grouped_matmul`` (as MindSpeed's grouped MLP calls it), gradients
    included. A rank whose local experts received no token at all computes nothing on the NPU, but its
    weights still get their (zero) gradients for the data-parallel reduction."""
    torch_provider.check_expert_counts(tokens_per_expert, weight)
    if x.shape[0] == 0:
        return torch_provider.looped_grouped_mm(x, weight, tokens_per_expert)
    return _GroupedMatmul.apply(x.contiguous(), _group_ends(tokens_per_expert, x.device), weight)


# Gated DeltaNet: torch_npu documents no op for the gated delta rule, the causal convolution or the L2 norm
# (../shared/reference/torch_npu.md); torch's ops run them on the NPU
chunk_gated_delta_rule = torch_provider.chunk_gated_delta_rule
causal_conv1d = torch_provider.causal_conv1d
l2norm = torch_provider.l2norm

complete(globals())  # the base's defaults for the rest, and the norm class NpuNorm

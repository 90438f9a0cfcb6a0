"""Double of torch_npu's fused ops, re-exported at top level (``torch_npu.npu_rms_norm`` ...) as the real
package exposes them.

Written from ../shared/reference/torch_npu.md ("torch_npu.npu_fusion_attention", "Other fused ops") and the
torch_npu API pages on hiascend.com, never from MindSpeed or Megatron code. What every op here does, and why:

- It adds one to ``CALLS[<op name>]`` before anything else, refused calls included, so a test can prove that
  a code path dispatched to torch_npu rather than to a torch fallback.
- It raises ``RuntimeError`` naming the argument for what the real op's documented constraints reject: the
  real ops fail at run time on the NPU, and a double that accepted more would let a CPU test pass on a call
  an NPU run refuses. ``NotImplementedError`` (a ``RuntimeError`` too) marks what the real op may accept but
  the double does not model, so a caller learns the double's limit instead of getting a wrong answer.
- Floating inputs must be float16, bfloat16 or float32 (the reference: float64 is treated as unsupported).
- It computes in float32 and casts outputs to the input dtype, as a fused kernel accumulates in float32,
  so float16/bfloat16 results are close to the kernel's, not bitwise equal.
- It is built from differentiable torch ops, so autograd works as through the real ops' backward nodes;
  the gradients are those of the documented formula.
"""

from __future__ import annotations

import functools
from collections import Counter

import torch
import torch.nn.functional as F

CALLS: Counter = Counter()

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_MASK_DTYPES = (torch.bool, torch.uint8)
_LAYOUTS = ("BSH", "SBH", "BSND", "BNSD", "TND")
_MAX_Q_HEADS = 256
_COMPRESSED_MASK_SIDE = 2048
_ROTARY_MODES = ("half", "interleave")
_ROTARY_MAX_D = 896  # exclusive
_SOFTMAX_MIN_SIDE, _SOFTMAX_MAX_SIDE, _SOFTMAX_SIDE_MULTIPLE = 32, 4096, 32
_SOFTMAX_MASK_FILL = -10000.0
_REDUCTIONS = ("mean", "sum", "none")
_CROSS_ENTROPY_MAX_N = 200_000


def _counted(op):
    """Counts every call in CALLS under the op's name; the count proves dispatch, not success."""

    @functools.wraps(op)
    def counted(*args, **kwargs):
        CALLS[op.__name__] += 1
        return op(*args, **kwargs)

    return counted


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise RuntimeError(message)


def _check_float(name: str, tensor) -> None:
    _check(isinstance(tensor, torch.Tensor), f"{name} must be a Tensor, got {type(tensor).__name__}")
    _check(tensor.dtype in _FLOATS, f"{name} dtype must be float16, bfloat16 or float32, got {tensor.dtype}")


def _broadcasts_to(shape, target) -> bool:
    """Whether ``shape`` broadcasts to exactly ``target`` (the ops do not grow their main input)."""
    return len(shape) <= len(target) and all(s in (1, t) for s, t in zip(reversed(shape), reversed(target)))


# ---------------------------------------------------------------- npu_rms_norm
@_counted
def npu_rms_norm(x, gamma, epsilon=1e-6):
    """RMSNorm over gamma's trailing dims: ``y = x * rsqrt(mean(x^2) + epsilon) * gamma`` in x's dtype.

    Returns ``(y, rstd)``; rstd is float32, shaped like x with the normalised dims kept as 1 (the kernel
    saves it for backward)."""
    _check_float("x", x)
    _check_float("gamma", gamma)
    ndim = gamma.dim()
    _check(1 <= ndim <= x.dim() and tuple(x.shape[x.dim() - ndim:]) == tuple(gamma.shape),
           f"gamma shape {tuple(gamma.shape)} must equal the trailing dims of x {tuple(x.shape)}")
    dims = tuple(range(x.dim() - ndim, x.dim()))
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(dim=dims, keepdim=True) + epsilon)
    return (x32 * rstd * gamma.float()).to(x.dtype), rstd


# ---------------------------------------------------------------- npu_swiglu
@_counted
def npu_swiglu(x, dim=-1):
    """``a, b = chunk(x, 2, dim); silu(a) * b``: the FIRST half is gated, as in Megatron's ``silu(y1) * y2``."""
    _check_float("x", x)
    _check(isinstance(dim, int) and -x.dim() <= dim < x.dim(), f"dim {dim!r} is out of range for x of {x.dim()} dims")
    _check(x.shape[dim] % 2 == 0, f"x size along dim {dim} must be even, got {x.shape[dim]}")
    a, b = x.float().chunk(2, dim=dim)
    return (F.silu(a) * b).to(x.dtype)


# ---------------------------------------------------------------- npu_rotary_mul
@_counted
def npu_rotary_mul(x, r1, r2, rotary_mode="half"):
    """Rotary embedding ``r1 * x + r2 * rotate(x)``, r1 = cos and r2 = sin over the full head dim.

    'half' rotates the halves (x1, x2) -> (-x2, x1) (HF rotate_half); 'interleave' rotates each
    (even, odd) pair -> (-odd, even). x is 4-D (BNSD, BSND or SBND: the op does not care which)."""
    for name, tensor in (("x", x), ("r1", r1), ("r2", r2)):
        _check_float(name, tensor)
    _check(x.dim() == 4, f"x must be 4-D (BNSD, BSND or SBND), got shape {tuple(x.shape)}")
    head_dim = x.shape[-1]
    _check(head_dim % 2 == 0 and head_dim < _ROTARY_MAX_D,
           f"x head dim D={head_dim} must be even and < {_ROTARY_MAX_D}")
    for name, tensor in (("r1", r1), ("r2", r2)):
        _check(_broadcasts_to(tuple(tensor.shape), tuple(x.shape)),
               f"{name} shape {tuple(tensor.shape)} must broadcast to x shape {tuple(x.shape)}")
    _check(rotary_mode in _ROTARY_MODES, f"rotary_mode must be one of {_ROTARY_MODES}, got {rotary_mode!r}")
    x32 = x.float()
    if rotary_mode == "half":
        first, second = x32.chunk(2, dim=-1)
        rotated = torch.cat((-second, first), dim=-1)
    else:
        rotated = torch.stack((-x32[..., 1::2], x32[..., 0::2]), dim=-1).flatten(-2)
    return (r1.float() * x32 + r2.float() * rotated).to(x.dtype)


# ---------------------------------------------------------------- npu_fusion_attention
def _to_bnsd(tensor, layout: str, heads: int):
    """[B, N, S, D] view of a BSH/SBH/BSND/BNSD tensor with ``heads`` heads."""
    if layout == "BSH":
        batch, seq, hidden = tensor.shape
        return tensor.reshape(batch, seq, heads, hidden // heads).transpose(1, 2)
    if layout == "SBH":
        seq, batch, hidden = tensor.shape
        return tensor.reshape(seq, batch, heads, hidden // heads).permute(1, 2, 0, 3)
    if layout == "BSND":
        return tensor.transpose(1, 2)
    return tensor


def _from_bnsd(tensor, layout: str):
    """Inverse of _to_bnsd for the attention output."""
    batch, heads, seq, head_dim = tensor.shape
    if layout == "BSH":
        return tensor.transpose(1, 2).reshape(batch, seq, heads * head_dim)
    if layout == "SBH":
        return tensor.permute(2, 0, 1, 3).reshape(seq, batch, heads * head_dim)
    if layout == "BSND":
        return tensor.transpose(1, 2)
    return tensor


def _kv_heads(query, key, head_num: int, layout: str) -> int:
    """Number of KV heads after checking the query's head count against head_num and the layout."""
    if layout in ("BSH", "SBH"):
        hidden_q, hidden_kv = query.shape[-1], key.shape[-1]
        _check(hidden_q % head_num == 0, f"query hidden size {hidden_q} must be divisible by head_num {head_num}")
        head_dim = hidden_q // head_num
        _check(hidden_kv % head_dim == 0,
               f"key hidden size {hidden_kv} must be a multiple of the head dim {head_dim} (query hidden / head_num)")
        return hidden_kv // head_dim
    head_axis = 1 if layout in ("BNSD", "TND") else 2
    _check(query.shape[head_axis] == head_num,
           f"head_num {head_num} must equal query's N ({query.shape[head_axis]}) for layout {layout}")
    _check(query.shape[-1] == key.shape[-1], f"query and key head dims differ: {query.shape[-1]} vs {key.shape[-1]}")
    return key.shape[head_axis]


def _cumulative(name: str, ends, total: int) -> list:
    """Sequence boundaries [0, *ends] from a cumulative list without the leading 0 ([2, 2, 2] -> [2, 4, 6])."""
    _check(isinstance(ends, (list, tuple)) and len(ends) > 0
           and all(isinstance(e, int) and not isinstance(e, bool) for e in ends),
           f"{name} must be a non-empty list of Python ints for input_layout TND, got {ends!r}")
    bounds = [0, *ends]
    _check(all(b > a for a, b in zip(bounds, bounds[1:])),
           f"{name} must be strictly increasing CUMULATIVE sequence ends without a leading 0 "
           f"(lengths [2, 2, 2] -> [2, 4, 6]), got {list(ends)}")
    _check(ends[-1] == total, f"{name} must end at the packed length T={total}, got {ends[-1]}")
    return bounds


def _check_atten_mask(atten_mask, sparse_mode: int, fits, expected: str) -> None:
    """Refuse a mask the kernel would: wrong dtype, a non-compressed mask for modes 2-4, a wrong shape."""
    _check(isinstance(atten_mask, torch.Tensor) and atten_mask.dtype in _MASK_DTYPES,
           "atten_mask must be a bool or uint8 Tensor (True/1 = masked out), got "
           f"{getattr(atten_mask, 'dtype', type(atten_mask).__name__)}")
    if sparse_mode in (2, 3, 4):
        side = _COMPRESSED_MASK_SIDE
        compressed = torch.ones(side, side, dtype=torch.bool, device=atten_mask.device).triu(1)
        _check(tuple(atten_mask.shape) == (side, side) and torch.equal(atten_mask.bool(), compressed),
               f"sparse_mode {sparse_mode} needs the compressed atten_mask "
               f"torch.triu(torch.ones({side}, {side}), 1) as bool/uint8, got shape {tuple(atten_mask.shape)}")
    else:
        _check(fits(tuple(atten_mask.shape)), f"atten_mask shape {tuple(atten_mask.shape)} must be {expected}")


def _masked_positions(atten_mask, sparse_mode: int, pre_tockens: int, next_tockens: int, sq: int, skv: int):
    """Bool mask (True = masked out) for query rows i and key columns j, broadcastable to [B, N, Sq, Skv].

    Modes 0/1 use ``atten_mask`` as given (mode 0 also masks outside the band j - i <= next_tockens,
    i - j <= pre_tockens); modes 2-4 build the mask from the formulas, the compressed mask being only a
    marker: 2 causal top-left (j > i), 3 causal bottom-right (j > i + Skv - Sq), 4 band bottom-right."""
    if atten_mask is None:
        return None
    if sparse_mode == 1:
        return atten_mask.bool()
    i = torch.arange(sq, device=atten_mask.device)[:, None]
    j = torch.arange(skv, device=atten_mask.device)[None, :]
    shift = skv - sq
    if sparse_mode == 0:
        return atten_mask.bool() | (j - i > next_tockens) | (i - j > pre_tockens)
    if sparse_mode == 2:
        return j > i
    if sparse_mode == 3:
        return j > i + shift
    return (j > i + shift + next_tockens) | (j < i + shift - pre_tockens)


def _attend(q, k, v, masked, scale: float, keep_prob: float):
    """softmax(Mask(scale * q k^T)) -> dropout -> @ v in float32 for q [B, Nq, Sq, D] and k, v [B, Nkv, Skv, D].

    Query head h reads KV head h // (Nq // Nkv) (the K/V heads are repeated, which is what that mapping
    means). A row whose keys are all masked gives zeros: the real kernel forbids such rows under varlen,
    and zeros (not NaN) keep a test's other rows and gradients usable. Returns the output and the row
    max / row sum of exp(score - max) the kernel hands back (-inf and 0 for a fully masked row)."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = scale * (q @ k.transpose(-2, -1))
    if masked is not None:
        scores = scores.masked_fill(masked, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True).detach()
    exp = torch.exp(scores - row_max.masked_fill(row_max == float("-inf"), 0.0))
    row_sum = exp.sum(dim=-1, keepdim=True)
    probs = exp / row_sum.masked_fill(row_sum == 0, 1.0)
    if keep_prob < 1.0:
        probs = F.dropout(probs, p=1.0 - keep_prob, training=True)
    return probs @ v, row_max.squeeze(-1), row_sum.detach().squeeze(-1)


def _softmax_stat(stat):
    """[..., 8] float32, the kernel's layout for softmax_max / softmax_sum (the value repeated 8 times)."""
    return stat.unsqueeze(-1).expand(*stat.shape, 8).contiguous()


@_counted
def npu_fusion_attention(query, key, value, head_num, input_layout, pse=None, padding_mask=None,
                         atten_mask=None, scale=1., keep_prob=1., pre_tockens=2147483647,
                         next_tockens=2147483647, inner_precise=0, prefix=None, actual_seq_qlen=None,
                         actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True, sync=False):
    """Flash attention: ``softmax(Mask(scale * Q K^T), atten_mask) -> dropout(keep_prob) -> @ V``.

    ``scale`` defaults to 1.0 (not 1/sqrt(D)), as on the real op. ``atten_mask`` True/1 masks a position
    out; None means full attention, with sparse_mode and the tockens ignored. Layouts BSH, SBH (H = N * D,
    head_num = Nq), BSND, BNSD and TND (packed varlen: ``actual_seq_qlen`` / ``actual_seq_kvlen`` are
    cumulative ends without the leading 0; masks apply per sequence with local indices, and a TND
    sparse_mode 0/1 mask is an [S, S] mask whose top-left [Sq_i, Skv_i] corner serves sequence i).
    GQA: Nq % Nkv == 0, Nq <= 256. Dropout draws from torch's default generator of the tensor's device.

    Returns ``(attention_out, softmax_max, softmax_sum, softmax_out, seed, offset, numels)``: the output in
    the input layout and dtype; float32 softmax_max / softmax_sum [B, N, Sq, 8] ([T, N, 8] for TND);
    softmax_out an empty tensor; seed = offset = 0, since the double's dropout draws from torch's
    generator and has no seed/offset pair to hand back; numels = the number of attention probabilities
    (B * N * Sq * Skv, or N * sum(Sq_i * Skv_i) for TND), the elements a dropout mask covers (inferred).

    Not modelled (NotImplementedError): pse, padding_mask, prefix, sparse_mode 5-8. inner_precise,
    gen_mask_parallel and sync are kernel precision/scheduling knobs with nothing to model on CPU: accepted
    and ignored."""
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        _check_float(name, tensor)
    _check(key.dtype == query.dtype and value.dtype == query.dtype,
           f"query, key and value must share a dtype, got {query.dtype}, {key.dtype}, {value.dtype}")
    for name, given in (("pse", pse), ("padding_mask", padding_mask), ("prefix", prefix)):
        if given is not None:
            raise NotImplementedError(f"{name} is not modelled by the double (pass None)")
    _check(input_layout in _LAYOUTS, f"input_layout must be one of {_LAYOUTS}, got {input_layout!r}")
    _check(isinstance(head_num, int) and not isinstance(head_num, bool) and head_num > 0,
           f"head_num must be a positive int, got {head_num!r}")
    _check(0.0 < keep_prob <= 1.0, f"keep_prob must be in (0, 1], got {keep_prob}")
    _check(isinstance(sparse_mode, int) and 0 <= sparse_mode <= 8, f"sparse_mode must be 0-8, got {sparse_mode!r}")
    if atten_mask is not None and sparse_mode >= 5:
        raise NotImplementedError(f"sparse_mode {sparse_mode} is not modelled by the double")
    rank = 4 if input_layout in ("BSND", "BNSD") else 3
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        _check(tensor.dim() == rank, f"{name} must be {rank}-D for input_layout {input_layout}, "
                                     f"got shape {tuple(tensor.shape)}")
    _check(tuple(key.shape) == tuple(value.shape),
           f"key and value must have the same shape, got {tuple(key.shape)} and {tuple(value.shape)}")
    kv_heads = _kv_heads(query, key, head_num, input_layout)
    _check(kv_heads > 0 and head_num % kv_heads == 0,
           f"head_num {head_num} must be a multiple of the key/value head count {kv_heads}")
    _check(head_num <= _MAX_Q_HEADS, f"head_num {head_num} must be <= {_MAX_Q_HEADS}")
    if input_layout == "TND":
        return _fusion_attention_tnd(query, key, value, atten_mask, scale, keep_prob, pre_tockens,
                                     next_tockens, actual_seq_qlen, actual_seq_kvlen, sparse_mode)
    _check(actual_seq_qlen is None and actual_seq_kvlen is None,
           f"actual_seq_qlen / actual_seq_kvlen are for input_layout TND only, not {input_layout}")

    q = _to_bnsd(query, input_layout, head_num)
    k = _to_bnsd(key, input_layout, kv_heads)
    v = _to_bnsd(value, input_layout, kv_heads)
    batch, _, sq, _ = q.shape
    skv = k.shape[2]
    _check(k.shape[0] == batch, f"query and key batch sizes differ: {batch} vs {k.shape[0]}")
    if atten_mask is not None:
        shapes = {(batch, head_num, sq, skv), (batch, 1, sq, skv), (1, 1, sq, skv), (sq, skv)}
        _check_atten_mask(atten_mask, sparse_mode, shapes.__contains__,
                          f"one of BNSS {(batch, head_num, sq, skv)}, B1SS, 11SS or SS {(sq, skv)}")
    masked = _masked_positions(atten_mask, sparse_mode, pre_tockens, next_tockens, sq, skv)
    out, row_max, row_sum = _attend(q.float(), k.float(), v.float(), masked, scale, keep_prob)
    return (_from_bnsd(out, input_layout).to(query.dtype), _softmax_stat(row_max), _softmax_stat(row_sum),
            query.new_empty(0), 0, 0, batch * head_num * sq * skv)


def _fusion_attention_tnd(query, key, value, atten_mask, scale, keep_prob, pre_tockens, next_tockens,
                          actual_seq_qlen, actual_seq_kvlen, sparse_mode):
    """TND (packed varlen): each packed sequence attends to its own keys only, with local indices."""
    q_bounds = _cumulative("actual_seq_qlen", actual_seq_qlen, query.shape[0])
    kv_bounds = _cumulative("actual_seq_kvlen", actual_seq_kvlen, key.shape[0])
    _check(len(q_bounds) == len(kv_bounds),
           f"actual_seq_qlen and actual_seq_kvlen must list as many sequences, got {len(q_bounds) - 1} "
           f"and {len(kv_bounds) - 1}")
    spans = list(zip(zip(q_bounds, q_bounds[1:]), zip(kv_bounds, kv_bounds[1:])))
    if atten_mask is not None:
        max_sq = max(q1 - q0 for (q0, q1), _ in spans)
        max_skv = max(k1 - k0 for _, (k0, k1) in spans)
        _check_atten_mask(atten_mask, sparse_mode,
                          lambda shape: len(shape) == 2 and shape[0] >= max_sq and shape[1] >= max_skv,
                          f"SS covering the longest sequences, at least {(max_sq, max_skv)}, for TND")
    heads = query.shape[1]
    outs, maxes, sums, numels = [], [], [], 0
    for (q0, q1), (k0, k1) in spans:
        sq, skv = q1 - q0, k1 - k0
        given = atten_mask[:sq, :skv] if atten_mask is not None and sparse_mode in (0, 1) else atten_mask
        masked = _masked_positions(given, sparse_mode, pre_tockens, next_tockens, sq, skv)
        q, k, v = (t.float().transpose(0, 1).unsqueeze(0) for t in (query[q0:q1], key[k0:k1], value[k0:k1]))
        out, row_max, row_sum = _attend(q, k, v, masked, scale, keep_prob)
        outs.append(out[0].transpose(0, 1))
        maxes.append(row_max[0].transpose(0, 1))
        sums.append(row_sum[0].transpose(0, 1))
        numels += heads * sq * skv
    return (torch.cat(outs).to(query.dtype), _softmax_stat(torch.cat(maxes)), _softmax_stat(torch.cat(sums)),
            query.new_empty(0), 0, 0, numels)


# ---------------------------------------------------------------- npu_cross_entropy_loss
@_counted
def npu_cross_entropy_loss(input, target, weight=None, reduction="mean", ignore_index=-100, label_smoothing=0.0,
                           lse_square_scale_for_zloss=0.0, return_zloss=False):
    """Fused log_softmax + nll_loss over input [N, C]: ``(loss, log_prob, zloss, lse_for_zloss)``.

    loss is torch.nn.functional.cross_entropy with the same reduction / ignore_index / label_smoothing,
    in input's dtype; log_prob = log_softmax(input) and lse_for_zloss = logsumexp over C ([N]), both
    float32. Targets must lie in [0, C) (the documented range): a negative ignore_index ignores nothing,
    so the HF habit of -100 labels is refused rather than silently read out of range. z-loss is documented
    as not yet supported: return_zloss=True or a nonzero lse_square_scale_for_zloss raise
    NotImplementedError, and zloss is zeros shaped like loss so callers get a tensor, not None. weight is
    not modelled (None only)."""
    if weight is not None:
        raise NotImplementedError("weight is not modelled by the double (pass None)")
    if return_zloss or lse_square_scale_for_zloss != 0.0:
        raise NotImplementedError("z-loss (return_zloss / lse_square_scale_for_zloss) is documented as "
                                  "not yet supported by npu_cross_entropy_loss")
    _check_float("input", input)
    _check(input.dim() == 2 and input.shape[0] > 0 and input.shape[1] > 0,
           f"input must be 2-D [N, C] with N, C > 0, got shape {tuple(input.shape)}")
    n, c = input.shape
    _check(n <= _CROSS_ENTROPY_MAX_N, f"input N={n} must be <= {_CROSS_ENTROPY_MAX_N}")
    _check(isinstance(target, torch.Tensor) and target.dtype == torch.int64,
           f"target must be an int64 Tensor, got {getattr(target, 'dtype', type(target).__name__)}")
    _check(tuple(target.shape) == (n,), f"target shape must be [N] = [{n}], got {tuple(target.shape)}")
    _check(reduction in _REDUCTIONS, f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    _check(ignore_index < c, f"ignore_index {ignore_index} must be < C={c}")
    _check(0.0 <= label_smoothing < 1.0, f"label_smoothing must be in [0, 1), got {label_smoothing}")
    _check(bool(((target >= 0) & (target < c)).all()), f"target values must be in [0, C={c})")
    x32 = input.float()
    loss = F.cross_entropy(x32, target, reduction=reduction, ignore_index=ignore_index,
                           label_smoothing=label_smoothing).to(input.dtype)
    return loss, F.log_softmax(x32, dim=-1), torch.zeros_like(loss), torch.logsumexp(x32, dim=-1)


# ---------------------------------------------------------------- npu_scaled_masked_softmax
@_counted
def npu_scaled_masked_softmax(x, mask, scale=1.0, fixed_triu_mask=False):
    """``softmax(masked_fill(x * scale, mask, -10000.0), dim=-1)`` in float32, returned in x's dtype.

    mask True = masked out. The fill value is inferred: the op is a drop-in for Megatron's scaled masked
    softmax, which fills -10000.0; Ascend's operator guide writes -inf. The two agree except on a fully
    masked row, which -10000.0 turns into a uniform row and -inf into NaN. fixed_triu_mask is documented
    as reserved (only False) and is refused."""
    if fixed_triu_mask:
        raise NotImplementedError("fixed_triu_mask=True is reserved in the torch_npu docs (only False) and "
                                  "not modelled by the double")
    _check_float("x", x)
    _check(x.dim() == 4, f"x must be 4-D, got shape {tuple(x.shape)}")
    for axis in (-2, -1):
        size = x.shape[axis]
        _check(_SOFTMAX_MIN_SIDE <= size <= _SOFTMAX_MAX_SIDE and size % _SOFTMAX_SIDE_MULTIPLE == 0,
               f"x size {size} along dim {axis} must be in [{_SOFTMAX_MIN_SIDE}, {_SOFTMAX_MAX_SIDE}] "
               f"and divisible by {_SOFTMAX_SIDE_MULTIPLE}")
    _check(isinstance(mask, torch.Tensor) and mask.dtype == torch.bool,
           f"mask must be a bool Tensor, got {getattr(mask, 'dtype', type(mask).__name__)}")
    _check(mask.dim() == 4 and tuple(mask.shape[-2:]) == tuple(x.shape[-2:])
           and _broadcasts_to(tuple(mask.shape), tuple(x.shape)),
           f"mask shape {tuple(mask.shape)} must be 4-D, end in x's last two dims and broadcast to "
           f"x shape {tuple(x.shape)}")
    scores = (x.float() * scale).masked_fill(mask, _SOFTMAX_MASK_FILL)
    return torch.softmax(scores, dim=-1).to(x.dtype)

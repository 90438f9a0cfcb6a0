"""Double of torch_npu's fused ops, re-exported at top level (``torch_npu.npu_rms_norm`` ...) as the real
package exposes them.

Written from ../shared/reference/torch_npu.md ("torch_npu.npu_fusion_attention", "Other fused ops", and under
"MoE and context-parallel ops": "npu_grouped_matmul (GMM)", "Token permute / unpermute, index form",
"Routing-map form", "Ring attention (context parallel)") and the torch_npu API pages on hiascend.com,
never from MindSpeed or Megatron code. What every op here does, and why:

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
  the gradients are those of the documented formula. The exception is ``npu_grouped_matmul``: torch_npu has
  no backward node for it, so the double's outputs carry no gradient either, and a caller that forgets to
  supply its own backward learns it on CPU, not first on an NPU.
"""

from __future__ import annotations

import functools
import itertools
from collections import Counter

import torch
import torch.nn.functional as F

CALLS: Counter = Counter()

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_MASK_DTYPES = (torch.bool, torch.uint8)
_LAYOUTS = ("BSH", "SBH", "BSND", "BNSD", "TND")
_MAX_Q_HEADS = 256
_MAX_HEAD_DIM = 768
_COMPRESSED_MASK_SIDE = 2048
_ROTARY_MODES = ("half", "interleave")
_ROTARY_MAX_D = 896  # exclusive
# Which of x's first three dims r1/r2 span (True) or hold at 1 (False), per x layout in Ascend's npu_rotary_mul
# constraints: BNSD takes 11SD/B1SD/BNSD, BSND 1S1D/BS1D/BSND, SBND S11D/SB1D/SBND. The op cannot tell the
# layouts apart from shapes, so the double takes their union; 111D and 1NSD fit none of them.
_ROTARY_R_SPANS = ((False, False, True), (True, False, True), (True, True, True),
                   (False, True, False), (True, True, False), (True, False, False))
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
    (even, odd) pair -> (-odd, even). x is 4-D (BNSD, BSND or SBND: the op does not care which). r1 and r2
    must be 4-D too and cover the full head dim (the reference: "full head dim, halves duplicated"), in one of
    the documented r layouts (see _ROTARY_R_SPANS): a [D] or [S, 1, D] cos that torch would broadcast, or a
    half-width one, is refused as the kernel refuses it. Not modelled: the kernel's B/N size limits, which
    need the layout the double cannot see."""
    for name, tensor in (("x", x), ("r1", r1), ("r2", r2)):
        _check_float(name, tensor)
    _check(x.dim() == 4, f"x must be 4-D (BNSD, BSND or SBND), got shape {tuple(x.shape)}")
    head_dim = x.shape[-1]
    _check(head_dim % 2 == 0 and head_dim < _ROTARY_MAX_D,
           f"x head dim D={head_dim} must be even and < {_ROTARY_MAX_D}")
    for name, tensor in (("r1", r1), ("r2", r2)):
        _check(_rotary_r_fits(tuple(tensor.shape), tuple(x.shape)),
               f"{name} shape {tuple(tensor.shape)} must be 4-D, end in x's full head dim D={head_dim} and lay "
               f"out as 11SD/B1SD/BNSD, 1S1D/BS1D/BSND or S11D/SB1D/SBND against x shape {tuple(x.shape)}")
    _check(rotary_mode in _ROTARY_MODES, f"rotary_mode must be one of {_ROTARY_MODES}, got {rotary_mode!r}")
    x32 = x.float()
    if rotary_mode == "half":
        first, second = x32.chunk(2, dim=-1)
        rotated = torch.cat((-second, first), dim=-1)
    else:
        rotated = torch.stack((-x32[..., 1::2], x32[..., 0::2]), dim=-1).flatten(-2)
    return (r1.float() * x32 + r2.float() * rotated).to(x.dtype)


def _rotary_r_fits(shape, x_shape) -> bool:
    """Whether an r1/r2 shape is 4-D, ends in x's D and spans x's leading dims as some layout allows."""
    if len(shape) != 4 or shape[-1] != x_shape[-1]:
        return False
    return any(all(r == x if spans else r == 1 for r, x, spans in zip(shape[:3], x_shape[:3], layout))
               for layout in _ROTARY_R_SPANS)


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


def _check_value(query, key, value, head_num: int, kv_heads: int, layout: str) -> int:
    """Value may have its own head size Dv (multi-latent attention), with Dq == Dk >= Dv, each in 1..768
    (torch_npu 2.14 docs); otherwise key and value share their shape. Returns the output's last dim
    (N * Dv for BSH/SBH, Dv otherwise)."""
    _check(tuple(key.shape[:-1]) == tuple(value.shape[:-1]),
           f"key and value must have the same shape but for the last dim, got {tuple(key.shape)} and "
           f"{tuple(value.shape)}")
    packed = layout in ("BSH", "SBH")
    if packed:
        _check(value.shape[-1] % kv_heads == 0,
               f"value hidden size {value.shape[-1]} must be a multiple of the key/value head count {kv_heads}")
    dk = key.shape[-1] // kv_heads if packed else key.shape[-1]
    dv = value.shape[-1] // kv_heads if packed else value.shape[-1]
    _check(1 <= dv <= dk <= _MAX_HEAD_DIM,
           f"head dims must satisfy 1 <= Dv <= Dk <= {_MAX_HEAD_DIM} (Dq == Dk), got Dk={dk}, Dv={dv}")
    return head_num * dv if packed else dv


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
    means). A row whose keys are all masked gives zeros (not NaN, so a test's other rows and gradients stay
    usable); the reference forbids such rows under varlen only, where _fusion_attention_tnd refuses them.
    Returns the output and the row max / row sum of exp(score - max) the kernel hands back (-inf and 0 for a
    fully masked row)."""
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
    cumulative ends without the leading 0; masks apply per sequence with local indices, a TND
    sparse_mode 0/1 mask is an [S, S] mask whose top-left [Sq_i, Skv_i] corner serves sequence i, and a
    fully masked query row is refused under TND, as the reference says varlen allows none).
    GQA: Nq % Nkv == 0, Nq <= 256. Head dims Dq == Dk >= Dv, each <= 768: value may be narrower (multi-latent
    attention), the output then has Dv. Dropout draws from torch's default generator of the tensor's device.

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
    kv_heads = _kv_heads(query, key, head_num, input_layout)
    _check(kv_heads > 0 and head_num % kv_heads == 0,
           f"head_num {head_num} must be a multiple of the key/value head count {kv_heads}")
    _check_value(query, key, value, head_num, kv_heads, input_layout)
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
    """TND (packed varlen): each packed sequence attends to its own keys only, with local indices.

    A query row left with no key is refused, not zeroed: the reference's "varlen: SS only; no fully masked
    row". That covers a given mask and the formulas alike (sparse_mode 3 on a sequence with Sq_i > Skv_i
    masks its first Sq_i - Skv_i rows whole)."""
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
    for index, ((q0, q1), (k0, k1)) in enumerate(spans):
        sq, skv = q1 - q0, k1 - k0
        given = atten_mask[:sq, :skv] if atten_mask is not None and sparse_mode in (0, 1) else atten_mask
        masked = _masked_positions(given, sparse_mode, pre_tockens, next_tockens, sq, skv)
        _check(masked is None or not bool(masked.all(dim=-1).any()),
               f"atten_mask (sparse_mode {sparse_mode}) masks every key of a query row of sequence {index} "
               f"(Sq={sq}, Skv={skv}): input_layout TND (varlen) allows no fully masked row")
        q, k, v = (t.float().transpose(0, 1).unsqueeze(0) for t in (query[q0:q1], key[k0:k1], value[k0:k1]))
        out, row_max, row_sum = _attend(q, k, v, masked, scale, keep_prob)
        outs.append(out[0].transpose(0, 1))
        maxes.append(row_max[0].transpose(0, 1))
        sums.append(row_sum[0].transpose(0, 1))
        numels += heads * sq * skv
    return (torch.cat(outs).to(query.dtype), _softmax_stat(torch.cat(maxes)), _softmax_stat(torch.cat(sums)),
            query.new_empty(0), 0, 0, numels)


# ---------------------------------------------------------------- npu_fusion_attention_grad
def _check_stat(name: str, stat, rows) -> None:
    """softmax_max / softmax_sum: float32 rows + [8] (the kernel's layout, the value repeated 8 times)."""
    _check(isinstance(stat, torch.Tensor) and stat.dtype == torch.float32,
           f"{name} must be a float32 Tensor, got {getattr(stat, 'dtype', type(stat).__name__)}")
    _check(tuple(stat.shape) == (*rows, 8), f"{name} must be {[*rows, 8]}, got {list(stat.shape)}")


def _grad_inputs(query, key, value, dy, attention_in, head_num, input_layout, softmax_in, keep_prob):
    """The checks npu_fusion_attention_grad shares with the forward, plus dy / attention_in, which must be
    shaped like the forward's output. Returns the key/value head count."""
    for name, tensor in (("query", query), ("key", key), ("value", value), ("dy", dy)):
        _check_float(name, tensor)
    _check(all(t.dtype == query.dtype for t in (key, value, dy)),
           f"query, key, value and dy must share a dtype, got {query.dtype}, {key.dtype}, {value.dtype}, {dy.dtype}")
    _check(input_layout in _LAYOUTS, f"input_layout must be one of {_LAYOUTS}, got {input_layout!r}")
    if input_layout == "TND":
        raise NotImplementedError("input_layout TND is not modelled by the double's npu_fusion_attention_grad")
    _check(isinstance(head_num, int) and not isinstance(head_num, bool) and head_num > 0,
           f"head_num must be a positive int, got {head_num!r}")
    rank = 4 if input_layout in ("BSND", "BNSD") else 3
    for name, tensor in (("query", query), ("key", key), ("value", value), ("dy", dy)):
        _check(tensor.dim() == rank, f"{name} must be {rank}-D for input_layout {input_layout}, "
                                     f"got shape {tuple(tensor.shape)}")
    kv_heads = _kv_heads(query, key, head_num, input_layout)
    _check(kv_heads > 0 and head_num % kv_heads == 0 and head_num <= _MAX_Q_HEADS,
           f"head_num {head_num} must be <= {_MAX_Q_HEADS} and a multiple of the key/value head count {kv_heads}")
    out_shape = (*query.shape[:-1], _check_value(query, key, value, head_num, kv_heads, input_layout))
    _check(tuple(dy.shape) == out_shape, f"dy must be shaped like the attention output {out_shape}, "
                                         f"got {tuple(dy.shape)}")
    _check(isinstance(attention_in, torch.Tensor) and attention_in.dtype == query.dtype
           and tuple(attention_in.shape) == out_shape,
           f"attention_in (the forward output) must be a {query.dtype} Tensor shaped {out_shape}")
    if softmax_in is not None and softmax_in.numel() > 0:
        raise NotImplementedError("a non-empty softmax_in is not modelled by the double (pass None or the "
                                  "forward's empty softmax_out)")
    if keep_prob != 1.0:
        raise NotImplementedError("keep_prob < 1 is not modelled by the double's npu_fusion_attention_grad: its "
                                  "forward draws dropout from torch's generator, with no seed/offset to replay")
    return kv_heads


def _attention_grads(q, k, v, dy, out, row_max, row_sum, masked, scale: float):
    """Flash attention's backward in float32 on BNSD tensors from the given row statistics:
    P = exp(scale q k^T - max) / sum (0 where masked or max = -inf), D = rowsum(dy * out),
    dS = P * (dy v^T - D), dq = scale dS k, dk = scale dS^T q, dv = P^T dy; dk / dv are summed over the
    query heads of each key/value head (GQA)."""
    group = q.shape[1] // k.shape[1]
    k_rep, v_rep = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    live = torch.isfinite(row_max)[..., None]
    shifted = scale * (q @ k_rep.transpose(-2, -1)) - torch.where(live, row_max[..., None], 0.0)
    probs = torch.where(live, torch.exp(shifted) / row_sum[..., None], 0.0)
    if masked is not None:
        probs = probs.masked_fill(masked, 0.0)
    delta = (dy * out).sum(dim=-1, keepdim=True)
    d_scores = probs * (dy @ v_rep.transpose(-2, -1) - delta)
    dq = scale * d_scores @ k_rep
    dk = (scale * d_scores.transpose(-2, -1) @ q).unflatten(1, (k.shape[1], group)).sum(dim=2)
    dv = (probs.transpose(-2, -1) @ dy).unflatten(1, (k.shape[1], group)).sum(dim=2)
    return dq, dk, dv


@_counted
def npu_fusion_attention_grad(query, key, value, dy, head_num, input_layout, *, pse=None, padding_mask=None,
                              atten_mask=None, softmax_max=None, softmax_sum=None, softmax_in=None,
                              attention_in=None, scale_value=1., keep_prob=1., pre_tockens=2147483647,
                              next_tockens=2147483647, inner_precise=0, seed=0, offset=0, numels=0, prefix=None,
                              actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True,
                              sync=False):
    """npu_fusion_attention's backward from PRECOMPUTED statistics: ``(dq, dk, dv, dpse, dsink)``.

    The gradients are flash attention's (see _attention_grads) with P rebuilt from the given softmax_max /
    softmax_sum (float32 [B, N, Sq, 8], slot 0 read) and D from attention_in, so a ring-attention caller can
    hand in the FINAL merged statistics and output with one step's K/V, as MindSpeed does (the reference's
    double formula, inferred). ``scale_value`` (not ``scale``) defaults to 1.0; masks, sparse_mode and the
    tockens mean what they mean in the forward. dq / dk / dv come back in the input layout and dtype, dk / dv
    with key/value's head count; dpse and dsink are empty tensors (no pse or sink is modelled; inferred).

    Not modelled (NotImplementedError): missing statistics or attention_in (the reference does not say what
    the op recomputes), pse, padding_mask, prefix, sparse_mode 5-8, input_layout TND, keep_prob < 1, a
    non-empty softmax_in. seed / offset / numels, inner_precise, gen_mask_parallel and sync are accepted and
    ignored (they only replay dropout or steer the kernel). The outputs carry no gradient of their own."""
    for name, given in (("pse", pse), ("padding_mask", padding_mask), ("prefix", prefix)):
        if given is not None:
            raise NotImplementedError(f"{name} is not modelled by the double (pass None)")
    for name, given in (("softmax_max", softmax_max), ("softmax_sum", softmax_sum), ("attention_in", attention_in)):
        if given is None:
            raise NotImplementedError(f"{name} is needed by the double's npu_fusion_attention_grad (it does not "
                                      "recompute the forward)")
    kv_heads = _grad_inputs(query, key, value, dy, attention_in, head_num, input_layout, softmax_in, keep_prob)
    _check(isinstance(sparse_mode, int) and 0 <= sparse_mode <= 8, f"sparse_mode must be 0-8, got {sparse_mode!r}")
    if atten_mask is not None and sparse_mode >= 5:
        raise NotImplementedError(f"sparse_mode {sparse_mode} is not modelled by the double")
    _check(actual_seq_qlen is None and actual_seq_kvlen is None,
           f"actual_seq_qlen / actual_seq_kvlen are for input_layout TND only, not {input_layout}")
    with torch.no_grad():
        q, dout, out = (_to_bnsd(t, input_layout, head_num).float() for t in (query, dy, attention_in))
        k, v = (_to_bnsd(t, input_layout, kv_heads).float() for t in (key, value))
        batch, _, sq, _ = q.shape
        skv = k.shape[2]
        _check(k.shape[0] == batch, f"query and key batch sizes differ: {batch} vs {k.shape[0]}")
        for name, stat in (("softmax_max", softmax_max), ("softmax_sum", softmax_sum)):
            _check_stat(name, stat, (batch, head_num, sq))
        if atten_mask is not None:
            shapes = {(batch, head_num, sq, skv), (batch, 1, sq, skv), (1, 1, sq, skv), (sq, skv)}
            _check_atten_mask(atten_mask, sparse_mode, shapes.__contains__,
                              f"one of BNSS {(batch, head_num, sq, skv)}, B1SS, 11SS or SS {(sq, skv)}")
        masked = _masked_positions(atten_mask, sparse_mode, pre_tockens, next_tockens, sq, skv)
        grads = _attention_grads(q, k, v, dout, out, softmax_max[..., 0], softmax_sum[..., 0], masked,
                                 scale_value)
    dq, dk, dv = (_from_bnsd(g, input_layout).to(query.dtype) for g in grads)
    return dq, dk, dv, query.new_empty(0), query.new_empty(0)


# ---------------------------------------------------------------- npu_ring_attention_update
_RING_LAYOUTS = ("SBH", "TND")
_RING_TND_MAX_D = 768


def _ring_rows(prev_out, input_layout: str, input_softmax_layout: str, heads: int, actual_seq_qlen):
    """The statistics' leading dims for an output in ``input_layout``, after the layout's own checks:
    SBH out [S, B, N*D] with stats [B, N, S, 8]; TND out [T, N, D] with stats [T, N, 8] (true TND only),
    D a multiple of 64 and <= 768, N <= 256, actual_seq_qlen an int64 Tensor cumulative WITH a leading 0."""
    _check(input_layout in _RING_LAYOUTS, f"input_layout must be one of {_RING_LAYOUTS}, got {input_layout!r}")
    _check(prev_out.dim() == 3, f"prev_out must be 3-D for input_layout {input_layout}, got {tuple(prev_out.shape)}")
    if input_layout == "SBH":
        _check(actual_seq_qlen is None, "actual_seq_qlen is for input_layout TND only")
        seq, batch, hidden = prev_out.shape
        _check(hidden % heads == 0, f"prev_out hidden size {hidden} must be a multiple of the statistics' N={heads}")
        return batch, heads, seq
    if input_softmax_layout != "TND":
        raise NotImplementedError("input_layout TND with input_softmax_layout "
                                  f"{input_softmax_layout!r} (per-sequence NTD statistics) is not modelled by the "
                                  "double: pass input_softmax_layout='TND'")
    tokens, heads_out, head_dim = prev_out.shape
    _check(head_dim % 64 == 0 and head_dim <= _RING_TND_MAX_D,
           f"TND head dim D={head_dim} must be a multiple of 64 and <= {_RING_TND_MAX_D}")
    _check(heads_out <= _MAX_Q_HEADS, f"TND head count N={heads_out} must be <= {_MAX_Q_HEADS}")
    _check(isinstance(actual_seq_qlen, torch.Tensor) and actual_seq_qlen.dtype == torch.int64
           and actual_seq_qlen.dim() == 1 and actual_seq_qlen.numel() >= 2,
           "actual_seq_qlen must be a 1-D int64 Tensor of cumulative ends WITH a leading 0 for input_layout TND")
    bounds = actual_seq_qlen.tolist()
    _check(bounds[0] == 0 and bounds[-1] == tokens and all(b > a for a, b in zip(bounds, bounds[1:])),
           f"actual_seq_qlen must rise strictly from 0 to T={tokens} (cumulative, leading 0), got {bounds}")
    return tokens, heads_out


@_counted
def npu_ring_attention_update(prev_out, prev_max, prev_sum, cur_out, cur_max, cur_sum, *, actual_seq_qlen=None,
                              input_layout="SBH", input_softmax_layout=""):
    """Merges two partial attention results over disjoint key sets by their softmax statistics:
    ``m = max(pm, cm); ps = p_sum exp(pm - m); cs = c_sum exp(cm - m); l = ps + cs;
    out = prev * ps/l + cur * cs/l``, returning ``(out, m, l)`` (stats float32, the value in all 8 slots).

    The ratios come from slot 0 and are cast to prev's dtype before they scale the outputs, as the reference
    says. SBH: out [S, B, N*D], stats [B, N, S, 8]; TND: see _ring_rows. A row with max -inf on both sides
    (no key at all) gives NaN, as the formula does. No autograd: the real op has no backward node."""
    for name, tensor in (("prev_out", prev_out), ("cur_out", cur_out)):
        _check_float(name, tensor)
    _check(cur_out.dtype == prev_out.dtype and tuple(cur_out.shape) == tuple(prev_out.shape),
           f"cur_out must match prev_out's dtype and shape, got {cur_out.dtype} {tuple(cur_out.shape)} against "
           f"{prev_out.dtype} {tuple(prev_out.shape)}")
    _check(isinstance(prev_max, torch.Tensor) and prev_max.dim() >= 2,
           f"prev_max must be a float32 [..., 8] Tensor, got {getattr(prev_max, 'shape', type(prev_max).__name__)}")
    heads = prev_max.shape[1]
    rows = _ring_rows(prev_out, input_layout, input_softmax_layout, heads, actual_seq_qlen)
    for name, stat in (("prev_max", prev_max), ("prev_sum", prev_sum), ("cur_max", cur_max), ("cur_sum", cur_sum)):
        _check_stat(name, stat, rows)
    with torch.no_grad():
        pm, cm, p_sum, c_sum = (s[..., 0] for s in (prev_max, cur_max, prev_sum, cur_sum))
        new_max = torch.maximum(pm, cm)
        prev_scaled, cur_scaled = p_sum * torch.exp(pm - new_max), c_sum * torch.exp(cm - new_max)
        new_sum = prev_scaled + cur_scaled
        prev_ratio, cur_ratio = (_ring_ratio(r / new_sum, input_layout, prev_out) for r in (prev_scaled, cur_scaled))
        out = prev_out.detach() * prev_ratio + cur_out.detach() * cur_ratio
    return out, _softmax_stat(new_max), _softmax_stat(new_sum)


def _ring_ratio(ratio, input_layout: str, out):
    """A per-row ratio ([B, N, S] or [T, N]) broadcast over D to out's layout, in out's dtype."""
    if input_layout == "TND":
        return ratio[..., None].to(out.dtype)
    batch, heads, seq = ratio.shape
    per_head = ratio.permute(2, 0, 1)[..., None].expand(seq, batch, heads, out.shape[-1] // heads)
    return per_head.reshape(out.shape).to(out.dtype)


# ---------------------------------------------------------------- npu_cross_entropy_loss
@_counted
def npu_cross_entropy_loss(input, target, weight=None, reduction="mean", ignore_index=-100, label_smoothing=0.0,
                           lse_square_scale_for_zloss=0.0, return_zloss=False):
    """Fused log_softmax + nll_loss over input [N, C]: ``(loss, log_prob, zloss, lse_for_zloss)``.

    loss is torch.nn.functional.cross_entropy with the same reduction / ignore_index / label_smoothing,
    in input's dtype; log_prob = log_softmax(input) and lse_for_zloss = logsumexp over C ([N]), both
    float32. Targets must lie in [0, C) (the documented range) and ignore_index must be an int < C, one
    below 0 meaning "nothing ignored" (Ascend's API page): so the HF habit of -100 labels is refused rather
    than silently ignored, and a target equal to a non-negative ignore_index adds nothing to the loss.
    z-loss is documented as not yet supported: return_zloss=True or a nonzero lse_square_scale_for_zloss
    raise NotImplementedError, and zloss is zeros shaped like loss so callers get a tensor, not None.
    weight is not modelled (None only)."""
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
    _check(isinstance(ignore_index, int) and not isinstance(ignore_index, bool) and ignore_index < c,
           f"ignore_index must be an int < C={c} (negative: nothing ignored), got {ignore_index!r}")
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


# ---------------------------------------------------------------- MoE: shared helpers
def _unmodelled(ok: bool, message: str) -> None:
    """NotImplementedError: a call the real op may accept but whose result the double does not model."""
    if not ok:
        raise NotImplementedError(message)


def _as_int(name: str, value) -> int:
    """A Python int from an int or a 0-dim integer Tensor (megatron counts tokens with ``routing_map.sum()``)."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_floating_point():
        value = int(value)
    _check(isinstance(value, int) and not isinstance(value, bool), f"{name} must be an int, got {value!r}")
    return value


def _index_rows(name: str, tensor):
    """int64 copy of a 1-D int32 index Tensor, the dtype the permute ops hand back and their unpermutes take."""
    _check(isinstance(tensor, torch.Tensor) and tensor.dtype == torch.int32 and tensor.dim() == 1,
           f"{name} must be a 1-D int32 Tensor (as the permute op returns it), got "
           f"{getattr(tensor, 'dtype', type(tensor).__name__)} of shape {tuple(getattr(tensor, 'shape', ()))}")
    return tensor.long()


def _check_2d(name: str, tensor) -> None:
    _check_float(name, tensor)
    _check(tensor.dim() == 2, f"{name} must be 2-D, got shape {tuple(tensor.shape)}")


def _scatter_rows(permuted, dest, source, weights, rows: int):
    """``out[dest[i]] += permuted[source[i]] * weights[i]`` over ``rows`` output rows, in float32, returned in
    permuted's dtype: gather then index_add, both differentiable, so gradients reach permuted and weights."""
    picked = permuted.float().index_select(0, source)
    if weights is not None:
        picked = picked * weights.float().unsqueeze(-1)
    return picked.new_zeros(rows, permuted.shape[1]).index_add(0, dest, picked).to(permuted.dtype)


# ---------------------------------------------------------------- npu_grouped_matmul
_GMM_MAX_GROUPS = 1024
_GMM_MAX_INNER = 65536  # exclusive, for K and N
_GMM_SPLIT_ITEMS = (0, 1, 2, 3)


def _is_transposed_view(tensor) -> bool:
    """Whether the last two dims are laid out column-major, as a ``.t()`` / ``transpose(-1, -2)`` view is."""
    return (tensor.dim() >= 2 and tensor.shape[-2] > 1 and tensor.shape[-1] > 1
            and tensor.stride(-2) == 1 and tensor.stride(-1) != 1)


def _check_tensor_list(name: str, tensors) -> None:
    _check(isinstance(tensors, (list, tuple)) and len(tensors) > 0,
           f"{name} must be a non-empty list of Tensors, got {type(tensors).__name__}")
    for index, tensor in enumerate(tensors):
        _check_float(f"{name}[{index}]", tensor)


def _check_inner(k: int, n: int) -> None:
    _check(k < _GMM_MAX_INNER and n < _GMM_MAX_INNER,
           f"x / weight inner dims K={k} and N={n} must be < {_GMM_MAX_INNER}")


def _gmm_grouping(group_list, group_type, group_list_type) -> int:
    """The grouping a call asks for, -1 (none), 0 (split M) or 2 (split K), after the documented pairings: a
    Tensor group_list needs an explicit group_type; a Python list is always cumulative and needs group_type
    None (the double then splits M, the only grouping a list can describe); no group_list means independent
    matmuls. group_type 1 (split N) is documented as unsupported."""
    _check(group_type != 1, "group_type 1 (split N) is unsupported by npu_grouped_matmul")
    _check(group_type in (None, -1, 0, 2), f"group_type must be None, -1, 0 or 2, got {group_type!r}")
    _check(group_list_type in (0, 1), f"group_list_type must be 0 (cumulative) or 1 (counts), got {group_list_type!r}")
    if group_list is None:
        _check(group_type in (None, -1), f"group_type {group_type} needs a group_list")
        return -1
    if isinstance(group_list, torch.Tensor):
        _check(group_type in (0, 2), f"a Tensor group_list needs an explicit group_type 0 or 2, got {group_type!r}")
        return group_type
    _check(isinstance(group_list, (list, tuple)),
           f"group_list must be a 1-D int64 Tensor or a Python list of ints, got {type(group_list).__name__}")
    _check(group_type is None, f"a Python-list group_list needs group_type=None, got {group_type!r}")
    _check(group_list_type == 0, "a Python-list group_list is always cumulative: group_list_type must be 0")
    return 0


def _gmm_bounds(group_list, group_list_type: int, total: int) -> list:
    """[0, end_1, ..., end_G] from a cumulative (type 0) or per-group counts (type 1) group_list over ``total``
    rows: cumulative ends must be non-decreasing and end at total; counts must sum to it and not be one."""
    if isinstance(group_list, torch.Tensor):
        _check(group_list.dim() == 1 and group_list.dtype == torch.int64,
               f"group_list must be a 1-D int64 Tensor, got {group_list.dtype} of shape {tuple(group_list.shape)}")
        values = group_list.tolist()
    else:
        values = list(group_list)
        _check(all(isinstance(v, int) and not isinstance(v, bool) for v in values),
               f"group_list must hold Python ints, got {values!r}")
    _check(0 < len(values) <= _GMM_MAX_GROUPS, f"group_list must hold 1 to {_GMM_MAX_GROUPS} groups, got {len(values)}")
    if group_list_type == 1:
        _check(len(values) != 1 and min(values) >= 0 and sum(values) == total,
               f"group_list counts (group_list_type 1) must be >= 0, more than one and sum to M={total}, got {values}")
        values = list(itertools.accumulate(values))
    bounds = [0, *values]
    _check(all(b >= a for a, b in zip(bounds, bounds[1:])) and bounds[-1] == total,
           f"group_list (group_list_type 0) must be non-decreasing cumulative ends ending at {total}, got {values}")
    return bounds


def _gmm_biases(bias, widths: list) -> list:
    """One float bias row [N_g] per group (from [b[G, N]] or G tensors [N_g]), or None per group."""
    if bias is None:
        return [None] * len(widths)
    _check_tensor_list("bias", bias)
    rows = list(bias[0].unbind(0)) if len(bias) == 1 and bias[0].dim() == 2 else list(bias)
    _check(len(rows) == len(widths) and all(tuple(b.shape) == (n,) for b, n in zip(rows, widths)),
           f"bias must be [b[G, N]] or G tensors [N] matching weight's N {widths}, got "
           f"{[tuple(b.shape) for b in bias]}")
    return rows


def _linear(x, weight, bias):
    """x @ weight (+ bias) in float32, cast back to x's dtype."""
    out = x.float() @ weight.float()
    return (out if bias is None else out + bias.float()).to(x.dtype)


def _gmm_ungrouped(x, weight, bias, split_item: int) -> list:
    """No group_list: y_i = x_i @ w_i (+ b_i), independent matmuls; split_item 2/3 concatenates them along M."""
    _check(len(x) == len(weight) <= _GMM_MAX_GROUPS,
           f"x and weight must list as many tensors, at most {_GMM_MAX_GROUPS}, got {len(x)} and {len(weight)}")
    _unmodelled(all(t.dim() == 2 for t in (*x, *weight)), "ungrouped npu_grouped_matmul on x / weight tensors "
                "that are not 2-D is not modelled by the double")
    biases = _gmm_biases(bias, [w.shape[1] for w in weight])
    outs = []
    for index, (xi, wi, bi) in enumerate(zip(x, weight, biases)):
        _check(not _is_transposed_view(xi), f"x[{index}] must not be a transposed view (only weight may be)")
        _check(xi.shape[1] == wi.shape[0], f"x[{index}] [M, K] and weight[{index}] [K, N] must share K, got "
                                           f"{tuple(xi.shape)} and {tuple(wi.shape)}")
        _check_inner(*wi.shape)
        outs.append(_linear(xi, wi, bi))
    if split_item in (2, 3):
        _check(len({out.shape[1] for out in outs}) == 1,
               "split_item 2/3 returns one tensor, concatenated along M: every weight needs the same N")
        return [torch.cat(outs)]
    return outs


def _gmm_split_m(x, weight, bias, group_list, group_list_type: int, split_item: int) -> list:
    """group_type 0 (the MoE forward): rows g[e-1]:g[e] of x[M, K] times expert e's [K, N] weight."""
    _check(len(x) == 1 and x[0].dim() == 2, f"x must be [x[M, K]], one 2-D tensor, to split M, got {len(x)} tensors")
    rows = x[0]
    _check(not _is_transposed_view(rows), "x must not be a transposed view (only weight may be)")
    if len(weight) == 1 and weight[0].dim() == 3:
        experts = list(weight[0].unbind(0))
    else:
        _check(all(w.dim() == 2 for w in weight), "weight must be [w[E, K, N]] or a list of E [K, N] tensors")
        experts = list(weight)
    k, n = rows.shape[1], experts[0].shape[-1]
    _check(all(tuple(w.shape) == (k, n) for w in experts),
           f"weight must hold [K, N] = {(k, n)} per expert (K from x), got {[tuple(w.shape) for w in experts]}")
    _check_inner(k, n)
    bounds = _gmm_bounds(group_list, group_list_type, rows.shape[0])
    _check(len(bounds) - 1 == len(experts),
           f"group_list has {len(bounds) - 1} groups but weight has {len(experts)} experts")
    biases = _gmm_biases(bias, [n] * len(experts))
    outs = [_linear(rows[a:b], w, b_) for a, b, w, b_ in zip(bounds, bounds[1:], experts, biases)]
    return [torch.cat(outs)] if split_item in (2, 3) else outs


def _gmm_split_k(x, weight, bias, group_list, group_list_type: int, split_item: int) -> list:
    """group_type 2 (weight grads): out[e] = x_t[:, g[e-1]:g[e]] @ dy[g[e-1]:g[e]], stacked to [G, K, N]; an
    empty group gives zeros (the reference leaves the real value unverified). x_t is usually ``x.t()``."""
    _unmodelled(bias is None, "bias with group_type 2 is not modelled by the double")
    _unmodelled(split_item in (2, 3), "group_type 2 with split_item 0/1 is not modelled by the double "
                                      "(the documented weight-grad call uses split_item 3)")
    _check(len(x) == 1 and x[0].dim() == 2 and len(weight) == 1 and weight[0].dim() == 2,
           "group_type 2 takes x = [x_t[K, M]] and weight = [dy[M, N]], one 2-D tensor each")
    x_t, dy = x[0], weight[0]
    _check(x_t.shape[1] == dy.shape[0], f"x[0] [K, M] and weight[0] [M, N] must share M, got "
                                        f"{tuple(x_t.shape)} and {tuple(dy.shape)}")
    _check_inner(x_t.shape[0], dy.shape[1])
    bounds = _gmm_bounds(group_list, group_list_type, dy.shape[0])
    grads = [x_t[:, a:b].float() @ dy[a:b].float() for a, b in zip(bounds, bounds[1:])]
    return [torch.stack(grads).to(x_t.dtype)]


@_counted
def npu_grouped_matmul(x, weight, *, bias=None, group_list=None, split_item=0, group_type=None, group_list_type=0,
                       output_dtype=None, **unmodelled):
    """Grouped matmul, non-quantised: ``y_i = x_i @ w_i (+ b_i)`` in float32, returned in x's dtype.

    - group_type 0 (split M, the MoE forward): x = [x[M, K]], weight = [w[E, K, N]] (a transposed view of a
      [E, N, K] tensor is fine) or E tensors [K, N]; rows g[e-1]:g[e] use expert e.
    - group_type 2 (split K, weight grads): x = [x_t[K, M]], weight = [dy[M, N]] -> [[G, K, N]].
    - no group_list (group_type None or -1): independent matmuls per list entry.
    group_list is a 1-D int64 Tensor (group_list_type 0 cumulative ends, 1 counts; needs group_type 0 or 2) or
    a Python list (always cumulative; needs group_type None; the double reads it as split M, the reference
    not saying). split_item 0/1 return one output per group, 2/3 one tensor. Refused as the reference says the
    real op refuses: group_type 1, more than 1024 groups, inner dims K or N >= 65536, an x that is a
    transposed view (split M / ungrouped), non-float dtypes; and (inferred) x and weight of different dtypes.

    NO autograd: torch_npu has no grouped-matmul backward node (MindSpeed supplies its own), so the outputs
    are computed without grad and carry none; a caller that forgets its own backward gets no gradient here,
    as on an NPU. Quantisation arguments (scale, offset, antiquant_*, per_token_scale, activation_input,
    act_type, ... passed through ``unmodelled``) and an output_dtype other than x's raise NotImplementedError."""
    for name, value in unmodelled.items():
        _unmodelled(value is None or (name == "act_type" and value == 0),
                    f"{name} is not modelled by the double (non-quantised GMM only: leave it unset)")
    _check_tensor_list("x", x)
    _check_tensor_list("weight", weight)
    dtype = x[0].dtype
    _check(all(t.dtype == dtype for t in (*x, *weight)),
           f"x and weight must share one dtype (non-quantised GMM), got {[t.dtype for t in (*x, *weight)]}")
    _unmodelled(output_dtype in (None, dtype), f"output_dtype {output_dtype} differs from x's {dtype}: that is "
                                               "quantised GMM, not modelled by the double")
    _check(split_item in _GMM_SPLIT_ITEMS, f"split_item must be 0, 1, 2 or 3, got {split_item!r}")
    grouping = _gmm_grouping(group_list, group_type, group_list_type)
    with torch.no_grad():  # the real op records no backward node
        if grouping == -1:
            return _gmm_ungrouped(x, weight, bias, split_item)
        split = _gmm_split_m if grouping == 0 else _gmm_split_k
        return split(x, weight, bias, group_list, group_list_type, split_item)


# ---------------------------------------------------------------- npu_moe_token_permute / unpermute (index form)
_PERMUTE_MAX_TOPK = 512
_PERMUTE_MAX_INDEX = 16777215  # exclusive
_INDEX_DTYPES = (torch.int32, torch.int64)


def _permute_rows(num_out_tokens, total: int) -> int:
    """Rows npu_moe_token_permute keeps of the T*k sorted ones: None/0 all, n > 0 the first min(n, T*k),
    n < 0 T*k + n."""
    if num_out_tokens is None:
        return total
    wanted = _as_int("num_out_tokens", num_out_tokens)
    rows = total if wanted == 0 else min(wanted, total) if wanted > 0 else total + wanted
    _check(rows >= 0, f"num_out_tokens {wanted} leaves {rows} of the T*k={total} rows")
    return rows


@_counted
def npu_moe_token_permute(tokens, indices, num_out_tokens=None, padded_mode=False):
    """Groups token copies by expert: ``(permuted[out, H], sorted_indices int32[T*k])``.

    indices [T, k] (or [T], k = 1) names each token's experts. The T*k flat entries t*k+j are sorted by expert
    with ties in flat order (stable), and row i of permuted is the token of the i-th sorted entry; out
    follows num_out_tokens (see _permute_rows). sorted_indices is the INVERSE of that order, so
    ``permuted[sorted_indices[i]] == tokens[i // k]``, and it is never cut to out rows. Built from argsort
    and index_select, so the gradient reaches tokens (the real op has a backward node).
    Refused as documented: padded_mode=True, k > 512, index values outside [0, 16777215) (the lower bound
    is inferred: an expert id), non-integer indices, non-float tokens."""
    _check(not padded_mode, "padded_mode=True is unsupported by npu_moe_token_permute")
    _check_2d("tokens", tokens)
    _check(isinstance(indices, torch.Tensor) and indices.dtype in _INDEX_DTYPES,
           f"indices must be an int32 or int64 Tensor, got {getattr(indices, 'dtype', type(indices).__name__)}")
    _check(indices.dim() in (1, 2) and indices.shape[0] == tokens.shape[0],
           f"indices must be [T, k] or [T] with T={tokens.shape[0]} (tokens' rows), got {tuple(indices.shape)}")
    topk = 1 if indices.dim() == 1 else indices.shape[1]
    _check(1 <= topk <= _PERMUTE_MAX_TOPK, f"indices top-k {topk} must be in [1, {_PERMUTE_MAX_TOPK}]")
    flat = indices.reshape(-1).long()
    _check(bool(((flat >= 0) & (flat < _PERMUTE_MAX_INDEX)).all()),
           f"indices values must be in [0, {_PERMUTE_MAX_INDEX})")
    order = torch.argsort(flat, stable=True)
    rows = _permute_rows(num_out_tokens, flat.numel())
    return tokens.index_select(0, order[:rows] // topk), torch.argsort(order).to(torch.int32)


@_counted
def npu_moe_token_unpermute(permuted_tokens, sorted_indices, probs=None, padded_mode=False, restore_shape=None):
    """Inverse of npu_moe_token_permute: ``out[t] = sum_j probs[t, j] * permuted[sorted_indices[t*k + j]]``.

    k = probs.size(1) (1 without probs, the weights then being 1), T = len(sorted_indices) / k; out is
    [T, H] in permuted's dtype, summed in float32. Built from index_select and index_add, so gradients reach
    permuted_tokens and probs (the real op has a backward node). restore_shape, when given, must be [T, H]
    (inferred: the reference only names the argument).
    A sorted_indices entry past permuted's rows (a row num_out_tokens dropped) raises NotImplementedError:
    the reference leaves what the real op does with it unverified. padded_mode=True is refused."""
    _check(not padded_mode, "padded_mode=True is unsupported by npu_moe_token_unpermute")
    _check_2d("permuted_tokens", permuted_tokens)
    slots = _index_rows("sorted_indices", sorted_indices)
    topk = 1
    if probs is not None:
        _check_2d("probs", probs)
        topk = probs.shape[1]
    tokens = slots.numel() // topk
    _check(topk > 0 and tokens * topk == slots.numel() and (probs is None or probs.shape[0] == tokens),
           f"sorted_indices holds {slots.numel()} entries: it must be T*k with probs [T, k], got probs "
           f"{None if probs is None else tuple(probs.shape)}")
    hidden = permuted_tokens.shape[1]
    _check(restore_shape is None or tuple(restore_shape) == (tokens, hidden),
           f"restore_shape must be [T, H] = {[tokens, hidden]}, got {restore_shape}")
    _check(bool((slots >= 0).all()), "sorted_indices values must be >= 0")
    _unmodelled(bool((slots < permuted_tokens.shape[0]).all()),
                f"sorted_indices points past permuted_tokens' {permuted_tokens.shape[0]} rows (rows dropped by "
                "num_out_tokens): the real op's handling of them is unverified, so the double does not model it")
    dest = torch.arange(slots.numel(), device=slots.device) // topk
    weights = None if probs is None else probs.reshape(-1)
    return _scatter_rows(permuted_tokens, dest, slots, weights, tokens)


# ---------------------------------------------------------------- routing-map form
def _routing(routing_map, tokens: int):
    """routing_map as bool [T, E] (True: token t goes to expert e), after checking dtype and rows."""
    _check(isinstance(routing_map, torch.Tensor) and routing_map.dtype in (torch.bool, torch.int8),
           "routing_map must be a bool or int8 Tensor, got "
           f"{getattr(routing_map, 'dtype', type(routing_map).__name__)}")
    _check(routing_map.dim() == 2 and routing_map.shape[0] == tokens,
           f"routing_map must be [T, E] with T={tokens}, got shape {tuple(routing_map.shape)}")
    return routing_map.bool()


def _check_map_probs(probs, dtype, tokens: int, routing) -> None:
    """probs [T, E] (E from routing_map when given) in the tokens' dtype: MindSpeed casts tokens and probs to
    float32 together when exactly one of them is float32, which says the ops take one dtype (inferred)."""
    _check_2d("probs", probs)
    _check(probs.dtype == dtype, f"probs dtype {probs.dtype} must match the tokens' {dtype}")
    experts = probs.shape[1] if routing is None else routing.shape[1]
    _check(tuple(probs.shape) == (tokens, experts), f"probs must be [T, E] = {[tokens, experts]}, got "
                                                    f"{tuple(probs.shape)}")


def _check_topk_rows(routing, topk: int) -> None:
    """Without drop_and_pad every token needs the same k experts: the op reads k as num_out_tokens // T."""
    bad = (routing.sum(dim=1) != topk).nonzero().flatten().tolist()
    _check(not bad, f"routing_map rows {bad} do not route to exactly k = num_out_tokens // T = {topk} experts, "
                    "as every row must without drop_and_pad")


def _permute_padded(tokens, routing, probs, num_out_tokens):
    """drop_and_pad: capacity = num_out_tokens // E slots per expert, filled expert-major with its routed
    tokens in ascending order, extras dropped; sorted_indices holds each slot's token id."""
    _check(num_out_tokens is not None, "num_out_tokens is needed with drop_and_pad (capacity = num_out_tokens // E)")
    experts = routing.shape[1]
    capacity = _as_int("num_out_tokens", num_out_tokens) // experts
    short = (routing.sum(dim=0) < capacity).nonzero().flatten().tolist()
    _unmodelled(not short, f"routing_map routes fewer than capacity={capacity} tokens to experts {short}: what "
                           "fills their spare slots is not modelled (Megatron: unrouted token ids; the reference: "
                           "sorted_indices may hold -1)")
    slots = torch.cat([routing[:, e].nonzero().flatten()[:capacity] for e in range(experts)])
    expert_of_slot = torch.arange(experts, device=slots.device).repeat_interleave(capacity)
    permuted_probs = None if probs is None else probs[slots, expert_of_slot]
    return tokens.index_select(0, slots), permuted_probs, slots.to(torch.int32)


@_counted
def npu_moe_token_permute_with_routing_map(tokens, routing_map, *, probs=None, num_out_tokens=None,
                                           drop_and_pad=False):
    """Megatron's ``moe_utils.permute`` as one op: ``(permuted[out, H], permuted_probs[out] | None,
    sorted_indices int32[out])``.

    Without drop_and_pad: k = num_out_tokens // T (None means T, so k = 1: pass routing_map.sum()), every
    routing_map row needs exactly k experts, out = k * T. permuted and permuted_probs are expert-major,
    token-ascending (``probs.T.masked_select(routing_map.T)``); sorted_indices = argsort of that token-index
    list (stable), so ``permuted[sorted_indices[i]] == tokens[i // k]``. With drop_and_pad see
    _permute_padded; an expert short of capacity raises NotImplementedError.

    Autograd: the reference names no backward node for the routing-map ops (MindSpeed wraps them in its own
    autograd Functions), so the double gives them the gradients of the documented gathers, through
    index_select / masked_select: to tokens and probs."""
    _check_2d("tokens", tokens)
    count = tokens.shape[0]
    _check(count > 0, "tokens must hold at least one row")
    routing = _routing(routing_map, count)
    if probs is not None:
        _check_map_probs(probs, tokens.dtype, count, routing)
    if drop_and_pad:
        return _permute_padded(tokens, routing, probs, num_out_tokens)
    topk = (count if num_out_tokens is None else _as_int("num_out_tokens", num_out_tokens)) // count
    _check(topk >= 1, f"num_out_tokens {num_out_tokens} must be at least T={count} (k = num_out_tokens // T >= 1)")
    _check_topk_rows(routing, topk)
    expert_major = routing.T
    token_ids = torch.arange(count, device=tokens.device).expand_as(expert_major).masked_select(expert_major)
    permuted_probs = None if probs is None else probs.T.masked_select(expert_major)
    sorted_indices = torch.argsort(token_ids, stable=True).to(torch.int32)
    return tokens.index_select(0, token_ids), permuted_probs, sorted_indices


def _unpermute_plain(slots, valid, probs, routing, tokens: int, rows: int):
    """Non-pad sources: ``out[i // k] += permuted[s[i]] * permuted_probs[s[i]]``, as (dest, source, weights)."""
    topk = slots.numel() // tokens
    _check(topk * tokens == slots.numel() == rows,
           f"sorted_indices must hold one entry per permuted row, k * T with T={tokens}: got {slots.numel()} "
           f"entries for {rows} rows")
    _check(bool((slots < rows).all()), f"sorted_indices values must be < permuted_tokens' {rows} rows")
    weights = None
    if probs is not None:
        _check(routing is not None, "routing_map is needed with probs (it selects the probs of each permuted row)")
        _check_topk_rows(routing, topk)
        weights = probs.T.masked_select(routing.T).index_select(0, slots[valid])
    return valid // topk, slots[valid], weights


def _unpermute_padded(slots, valid, probs, tokens: int, rows: int):
    """drop_and_pad sources: ``out[s[j]] += permuted[j] * probs[s[j], j // capacity]``, as (dest, source,
    weights); capacity = len(sorted_indices) / E."""
    _check(slots.numel() == rows,
           f"sorted_indices must hold one token id per permuted row ({rows}), got {slots.numel()}")
    _check(bool((slots < tokens).all()), f"sorted_indices values must be token ids < T={tokens} with drop_and_pad")
    weights = None
    if probs is not None:
        experts = probs.shape[1]
        _check(rows % experts == 0, f"permuted_tokens' {rows} rows must be E * capacity with E={experts}")
        weights = probs[slots[valid], valid // (rows // experts)]
    return slots[valid], valid, weights


@_counted
def npu_moe_token_unpermute_with_routing_map(permuted_tokens, sorted_indices, restore_shape, *, probs=None,
                                             routing_map=None, drop_and_pad=False):
    """Megatron's ``moe_utils.unpermute`` as one op: sums the permuted rows back into ``restore_shape`` [T, H],
    each weighted by its prob when probs [T, E] is given, in float32, returned in permuted's dtype.

    Non-pad: ``out[i // k] += permuted[s[i]] * permuted_probs[s[i]]`` with k = len(s) / T and permuted_probs
    selected expert-major by routing_map (needed with probs). drop_and_pad: ``out[s[j]] += permuted[j] *
    probs[s[j], j // capacity]``. A sorted_indices entry of -1 marks an invalid slot and adds nothing. The
    double's autograd (see npu_moe_token_permute_with_routing_map) reaches permuted_tokens and probs."""
    _check_2d("permuted_tokens", permuted_tokens)
    slots = _index_rows("sorted_indices", sorted_indices)
    rows, hidden = permuted_tokens.shape
    shape = tuple(restore_shape) if isinstance(restore_shape, (list, tuple, torch.Size)) else None
    _check(shape is not None and len(shape) == 2 and shape[0] > 0 and shape[1] == hidden,
           f"restore_shape must be [T, H] with H={hidden} (permuted_tokens' width), got {restore_shape!r}")
    tokens = shape[0]
    routing = None if routing_map is None else _routing(routing_map, tokens)
    if probs is not None:
        _check_map_probs(probs, permuted_tokens.dtype, tokens, routing)
    _check(bool((slots >= -1).all()), "sorted_indices values must be >= -1 (-1: an invalid slot)")
    valid = (slots >= 0).nonzero().flatten()
    if drop_and_pad:
        dest, source, weights = _unpermute_padded(slots, valid, probs, tokens, rows)
    else:
        dest, source, weights = _unpermute_plain(slots, valid, probs, routing, tokens, rows)
    return _scatter_rows(permuted_tokens, dest, source, weights, tokens)

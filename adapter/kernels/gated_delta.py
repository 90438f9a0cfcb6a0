"""Gated DeltaNet's three kernels in plain PyTorch, with flash-linear-attention's interfaces (what megatron's
``GatedDeltaNet`` calls): the gated delta rule, the causal depthwise convolution, and the L2 norm.

The gated delta rule (Yang, Kautz and Hatamizadeh, "Gated Delta Networks", 2024) keeps, per head, a state
S in R^{dk x dv} that each token t decays and corrects towards its value:

    S_t = exp(g_t) S_{t-1} + k_t beta_t (v_t - exp(g_t) S_{t-1}^T k_t)^T,    o_t = S_t^T q_t

Token by token that is a sequential loop; here it runs by chunks of C tokens (the WY form of Yang et al.,
"Parallelizing Linear Transformers with the Delta Rule over Sequence Length", 2024). Inside a chunk entered
with state S0, with G_i the cumulative log-decay since the chunk's start and D_ij = exp(G_i - G_j) for j <= i:

    the corrections   Delta = U - W S0,  where (I + A) [U | W] = [beta v | beta exp(G) k],
                      A_ij = beta_i D_ij (k_i . k_j) for j < i (unit lower triangular: one solve)
    the outputs       O = exp(G) q S0 + ((q k^T) * D) Delta
    the next state    S_C = exp(G_C) S0 + (exp(G_C - G) k)^T Delta

so the sequential part is one small matrix step per chunk. Everything is computed in float32 (float64 for
float64 inputs) and returned in the inputs' dtype; autograd differentiates it. Training only: megatron passes
no initial or final state.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from adapter.kernels import UnsupportedKernelSetting

CHUNK = 64


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` along ``dim``, computed in at least float32 (flash-linear-attention's)."""
    wide = x.to(torch.promote_types(x.dtype, torch.float32))
    return (wide * torch.rsqrt(wide.square().sum(dim, keepdim=True) + eps)).to(x.dtype)


def _training_only(initial_state, output_final_state) -> None:
    if initial_state is not None or output_final_state:
        raise UnsupportedKernelSetting(
            "a recurrent state passed in or out of a Gated DeltaNet kernel is for inference, which the adapter's "
            "kernels do not run: pass initial_state=None, output_final_state=False")


def _per_sequence(kernel, cu_seqlens, *tensors):
    """``kernel`` on each packed sequence of a batch of one (dim 1 is time), concatenated back: every
    sequence starts from a zero state and sees none of its neighbours."""
    if tensors[0].shape[0] != 1:
        raise UnsupportedKernelSetting(f"packed sequences (cu_seqlens) come as a batch of one, not "
                                       f"{tensors[0].shape[0]}: pass [1, total tokens, ...]")
    bounds = cu_seqlens.tolist()
    return torch.cat([kernel(*(t[:, start:end] for t in tensors)) for start, end in zip(bounds, bounds[1:])], dim=1)


def causal_conv1d(x, weight, bias=None, activation=None, initial_state=None, output_final_state=False,
                  cu_seqlens=None):
    """Depthwise causal convolution over time: x [b, s, d], weight [d, w] -> (y [b, s, d], None), y_t from
    x_{t-w+1..t}, then ``activation`` ("silu"/"swish" or None). y is made contiguous before the activation:
    the activation's backward then meets its gradient in one layout (on the CPU it takes a slow path over a
    transposed input), and the caller's reshapes of y are views."""
    _training_only(initial_state, output_final_state)
    if activation not in (None, "silu", "swish"):
        raise UnsupportedKernelSetting(f"causal_conv1d activation={activation!r}: use 'silu' (or None)")

    def conv(x):
        y = F.conv1d(F.pad(x.transpose(1, 2), (weight.shape[1] - 1, 0)), weight.unsqueeze(1), bias,
                     groups=weight.shape[0]).transpose(1, 2).contiguous()
        return F.silu(y) if activation else y

    return (conv(x) if cu_seqlens is None else _per_sequence(conv, cu_seqlens, x)), None


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    """The gated delta rule by chunks: q, k [b, s, h, dk], v [b, s, hv, dv] (hv a multiple of h; each
    query/key head serves hv / h consecutive value heads), g (log-decay) and beta [b, s, hv] ->
    (o [b, s, hv, dv] in v's dtype, None). ``scale`` defaults to dk^-1/2; ``cu_seqlens`` packs sequences
    into a batch of one."""
    _training_only(initial_state, output_final_state)

    def rule(q, k, v, g, beta):
        return _chunked(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)

    if cu_seqlens is None:
        return rule(q, k, v, g, beta), None
    return _per_sequence(rule, cu_seqlens, q, k, v, g, beta), None


def _heads_first(q, k, v, g, beta, scale, qk_l2norm):
    """[b, hv, s, d] float32 q (l2-normed if asked, scaled), k, v and [b, hv, s] g, beta, each contiguous:
    the cast and the transpose are one copy, and ``_chunks`` can cut a contiguous tensor without another."""
    heads = v.shape[2]
    if heads % k.shape[2]:
        raise UnsupportedKernelSetting(f"{v.shape[2]} value heads over {k.shape[2]} key heads: the value heads "
                                       "must be a multiple of the query/key heads")
    if heads != k.shape[2]:  # megatron's layer repeats them itself; a repeat by 1 would copy
        q, k = (t.repeat_interleave(heads // t.shape[2], dim=2) for t in (q, k))
    precision = torch.promote_types(v.dtype, torch.float32)
    q, k, v, g, beta = (t.transpose(1, 2).to(precision, memory_format=torch.contiguous_format)
                        for t in (q, k, v, g, beta))
    if qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    return q * (q.shape[-1] ** -0.5 if scale is None else scale), k, v, g, beta


def _chunks(t: torch.Tensor, length: int) -> torch.Tensor:
    """[b, h, s, ...] zero-padded to ``length`` (where s falls short of it) and cut into [b, h, n, CHUNK, ...].
    A padded token has no key, no value, beta 0 and decay 1: it changes neither the state nor an earlier
    output."""
    if length != t.shape[2]:
        t = F.pad(t, [0, 0] * (t.dim() - 3) + [0, length - t.shape[2]])
    return t.reshape(*t.shape[:2], length // CHUNK, CHUNK, *t.shape[3:])


class _PairwiseDecay(torch.autograd.Function):
    """D [.., C, C] from G [.., C]: D_ij = exp(G_i - G_j) for j <= i, 0 above the diagonal, made in place in
    one buffer, its gradient one product (dD_ij/dG_i = D_ij = -dD_ij/dG_j). A decay below the square root
    of the dtype's smallest normal number (1e-19 in float32) comes out at that root: most of a chunk's decays
    are far smaller (a few tokens of decay reach e^-87), and on the CPU torch's vectorised exp takes a scalar
    path, ten times slower, wherever its result would be subnormal, and a product with a subnormal operand or
    result is slow too; at the root, the decays and their products with the other factors stay normal. The
    values so raised are below 1e-19 (1e-154 in float64), far under the rounding of the sums they enter, as
    are their gradients."""

    @staticmethod
    def forward(ctx, log_decay):
        floor = math.log(torch.finfo(log_decay.dtype).tiny) / 2
        upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=log_decay.device).triu(1)
        decay = (log_decay.unsqueeze(-1) - log_decay.unsqueeze(-2)).clamp_(floor, 0.0).exp_().masked_fill_(upper, 0)
        ctx.save_for_backward(decay)
        return decay

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        grad = grad * ctx.saved_tensors[0]
        return grad.sum(-1) - grad.sum(-2)


def _chunked(q, k, v, g, beta, scale, qk_l2norm):
    dtype, seq = v.dtype, v.shape[1]
    q, k, v, g, beta = _heads_first(q, k, v, g, beta, scale, qk_l2norm)
    length = -(-seq // CHUNK) * CHUNK
    q, k, v, g, beta = (_chunks(t, length) for t in (q, k, v, g, beta))
    log_decay = g.cumsum(-1)  # G_i, from each chunk's start
    decay = _PairwiseDecay.apply(log_decay)  # D
    growth = log_decay.exp().unsqueeze(-1)  # exp(G)
    k_beta = k * beta.unsqueeze(-1)
    # I + A, A strictly below the diagonal: the solve reads no more (unit diagonal), and its gradient with
    # respect to this matrix is strictly lower too, so the diagonal and the zeros above need no masking
    a = (k_beta @ k.transpose(-1, -2)) * decay
    rhs = torch.cat((v * beta.unsqueeze(-1), k_beta * growth), dim=-1)
    solved = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)
    u, w = solved.split([v.shape[-1], k.shape[-1]], dim=-1)
    k_to_end = k * (log_decay[..., -1:] - log_decay).exp().unsqueeze(-1)
    deltas, states = _across_chunks(u, w, k_to_end, log_decay[..., -1].exp())
    out = (q * growth) @ states + ((q @ k.transpose(-1, -2)) * decay) @ deltas
    return out.flatten(2, 3)[:, :, :seq].transpose(1, 2).to(dtype, memory_format=torch.contiguous_format)


def _across_chunks(u, w, k_to_end, chunk_decay):
    """The sequential part: per chunk n, its corrections Delta_n = U_n - W_n S_n and the state S_n it is
    entered with (zero for the first), stacked as [b, h, n, CHUNK, dv] and [b, h, n, dk, dv], so that the
    outputs of every chunk come from two batched products. Chunks are taken by ``unbind`` (one node whose
    backward stacks the gradients) rather than indexed one at a time (a zero-filled gradient per index);
    the last chunk's outgoing state is not computed, as nothing reads it."""
    state = u.new_zeros(*u.shape[:2], w.shape[-1], u.shape[-1])
    deltas, states = [], [state]
    chunks = list(zip(u.unbind(2), w.unbind(2), k_to_end.unbind(2), chunk_decay.unbind(2)))
    for n, (u_n, w_n, k_n, decay_n) in enumerate(chunks):
        delta = u_n if n == 0 else u_n - w_n @ state
        deltas.append(delta)
        if n + 1 < len(chunks):
            carried = k_n.transpose(-1, -2) @ delta
            state = carried if n == 0 else state * decay_n[..., None, None] + carried
            states.append(state)
    return torch.stack(deltas, dim=2), torch.stack(states, dim=2)

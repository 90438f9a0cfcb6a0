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
    x_{t-w+1..t}, then ``activation`` ("silu"/"swish" or None)."""
    _training_only(initial_state, output_final_state)
    if activation not in (None, "silu", "swish"):
        raise UnsupportedKernelSetting(f"causal_conv1d activation={activation!r}: use 'silu' (or None)")

    def conv(x):
        y = F.conv1d(F.pad(x.transpose(1, 2), (weight.shape[1] - 1, 0)), weight.unsqueeze(1), bias,
                     groups=weight.shape[0]).transpose(1, 2)
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
    """[b, hv, s, d] float32 q (l2-normed if asked, scaled), k, v and [b, hv, s] g, beta."""
    heads = v.shape[2]
    if heads % k.shape[2]:
        raise UnsupportedKernelSetting(f"{v.shape[2]} value heads over {k.shape[2]} key heads: the value heads "
                                       "must be a multiple of the query/key heads")
    q, k = (t.repeat_interleave(heads // t.shape[2], dim=2) for t in (q, k))
    precision = torch.promote_types(v.dtype, torch.float32)
    q, k, v, g, beta = (t.transpose(1, 2).to(precision) for t in (q, k, v, g, beta))
    if qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    return q * (q.shape[-1] ** -0.5 if scale is None else scale), k, v, g, beta


def _chunks(t: torch.Tensor, length: int) -> torch.Tensor:
    """[b, h, s, ...] zero-padded to ``length`` and cut into [b, h, n, CHUNK, ...]. A padded token has no key,
    no value, beta 0 and decay 1: it changes neither the state nor an earlier output."""
    pad = [0, 0] * (t.dim() - 3) + [0, length - t.shape[2]]
    t = F.pad(t, pad)
    return t.reshape(*t.shape[:2], length // CHUNK, CHUNK, *t.shape[3:])


def _chunked(q, k, v, g, beta, scale, qk_l2norm):
    dtype, seq = v.dtype, v.shape[1]
    q, k, v, g, beta = _heads_first(q, k, v, g, beta, scale, qk_l2norm)
    length = -(-seq // CHUNK) * CHUNK
    q, k, v, g, beta = (_chunks(t, length) for t in (q, k, v, g, beta))
    log_decay = g.cumsum(-1)  # G_i, from each chunk's start
    lower = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    decay = (log_decay.unsqueeze(-1) - log_decay.unsqueeze(-2)).masked_fill(~lower, float("-inf")).exp()  # D
    k_beta = k * beta.unsqueeze(-1)
    a = ((k_beta @ k.transpose(-1, -2)) * decay).tril(-1)  # I + A: its unit diagonal is implied
    rhs = torch.cat((v * beta.unsqueeze(-1), k_beta * log_decay.exp().unsqueeze(-1)), dim=-1)
    solved = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)
    u, w = solved.split([v.shape[-1], k.shape[-1]], dim=-1)
    within = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * log_decay.exp().unsqueeze(-1)
    k_to_end = k * (log_decay[..., -1:] - log_decay).exp().unsqueeze(-1)
    state = q.new_zeros(*q.shape[:2], k.shape[-1], v.shape[-1])
    outputs = []
    for n in range(q.shape[2]):
        delta = u[:, :, n] - w[:, :, n] @ state
        outputs.append(q_decayed[:, :, n] @ state + within[:, :, n] @ delta)
        state = state * log_decay[:, :, n, -1, None, None].exp() + k_to_end[:, :, n].transpose(-1, -2) @ delta
    out = torch.stack(outputs, dim=2).flatten(2, 3)[:, :, :seq]
    return out.transpose(1, 2).to(dtype)

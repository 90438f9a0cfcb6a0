"""The gated delta rule and the causal convolution token by token, straight from their definitions: the
references adapter/kernels/gated_delta.py's chunked forms are held to (float64 in the tests)."""

from __future__ import annotations

import torch


def recurrent_gated_delta_rule(q, k, v, g, beta, qk_l2norm: bool = False):
    """q, k [b, s, h, dk], v [b, s, hv, dv], g, beta [b, s, hv] -> o [b, s, hv, dv]: per head a state
    S [dk, dv], per token S <- exp(g) S; S <- S + k beta (v - S^T k)^T; o = S^T q / sqrt(dk)."""
    repeat = v.shape[2] // k.shape[2]
    q, k = (t.repeat_interleave(repeat, dim=2) for t in (q, k))
    if qk_l2norm:
        q, k = (t / torch.sqrt((t * t).sum(-1, keepdim=True) + 1e-6) for t in (q, k))
    q = q / q.shape[-1] ** 0.5
    state = v.new_zeros(v.shape[0], v.shape[2], k.shape[-1], v.shape[-1])
    outputs = []
    for t in range(v.shape[1]):
        state = state * g[:, t].exp()[..., None, None]
        error = v[:, t] - torch.einsum("bhkv,bhk->bhv", state, k[:, t])
        state = state + torch.einsum("bhk,bhv->bhkv", k[:, t], beta[:, t, :, None] * error)
        outputs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    return torch.stack(outputs, dim=1)


def causal_conv(x, weight, bias=None, silu: bool = True):
    """x [b, s, d], weight [d, w]: y_t = sum_i weight[:, i] * x_{t - (w - 1) + i} (zeros before the start)."""
    width = weight.shape[1]
    out = []
    for t in range(x.shape[1]):
        taps = [x[:, t - width + 1 + i] if t - width + 1 + i >= 0 else torch.zeros_like(x[:, 0]) for i in range(width)]
        out.append(sum(weight[:, i] * tap for i, tap in enumerate(taps)) + (0 if bias is None else bias))
    y = torch.stack(out, dim=1)
    return torch.nn.functional.silu(y) if silu else y

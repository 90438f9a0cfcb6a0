"""Core attention over a context-parallel (CP) group, for the sequence split megatron makes.

megatron splits a sequence of 2 x CP chunks so that causal work is balanced: CP rank r holds chunks r and
2CP-1-r, in that order (``megatron.core.utils.get_batch_on_this_cp_rank``), and its RoPE already uses those
chunks' positions. Megatron's own CP attention exists only inside Transformer Engine; these are the two
schemes its ``cp_comm_type`` names, over any kernel provider:

- ``p2p``, ring attention (Liu et al. 2023, "Ring Attention with Blockwise Transformers"): the K/V blocks
  travel round the ring; each rank attends its queries to every block it sees and merges the partial
  results by their log-sum-exp. With the load-balanced chunks, of the block of rank ``src`` rank ``r`` needs:
  its own block causally (its two chunks are in position order); from ``src < r`` the first chunk of the
  block, for all its queries; from ``src > r`` the whole block, for its second chunk only. Every step is
  half a block of work or a causal block, whatever the rank. The backward runs the ring again, each K/V
  block travelling with its gradient, which is home after CP steps: activations stay O(S / CP) per rank.
  The blocks run through the provider's ``attention_with_lse`` / ``attention_grad_from_lse`` (each
  step's backward fed what that step's forward kernel saved), and merge through its ``merge_with_lse``
  (``merge_with_lse`` below unless the provider has its own).
- ``a2a``, Ulysses (Jacobs et al. 2023, "DeepSpeed Ulysses"): an all-to-all trades the sequence split for a
  head split, each rank attends its heads over the whole sequence with the provider's plain ``attention``,
  and an all-to-all trades back. Query and key/value head counts (per TP rank) must divide by CP. Value
  heads may be narrower or wider than query/key ones (multi-latent attention): each tensor travels whole.

Ring attention here takes one head size for q, k and v (``RING_HEAD_SIZES``): MLA with ``p2p`` is refused
(at the core attention's construction, and in Megatron-LM's ``validate_args`` before any model is built).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from adapter.kernels import UnsupportedKernelSetting

COMM_TYPES = ("p2p", "a2a")
RING_HEAD_SIZES = ("the adapter's ring attention (cp_comm_type p2p) exchanges K/V blocks and merges partial outputs "
                   "of one head size; Ulysses (a2a) takes a value head size of its own")


def ring_refuses(qk_head_size, v_head_size, comm_types) -> bool:
    """Whether ring attention is among ``comm_types`` (a missing type is megatron's default, p2p) for query/key
    and value heads of different sizes, which it cannot take (``RING_HEAD_SIZES``)."""
    return (qk_head_size is not None and v_head_size is not None and qk_head_size != v_head_size
            and any((kind or "p2p") == "p2p" for kind in comm_types))


def check_cp_attention(cp_comm_type, heads: int, groups: int, cp: int) -> str:
    """The scheme for megatron's ``cp_comm_type`` (one per layer may be given as a list), refused by name
    where it cannot run."""
    kind = cp_comm_type[0] if isinstance(cp_comm_type, (list, tuple)) else cp_comm_type
    kind = kind or "p2p"
    if kind not in COMM_TYPES:
        raise UnsupportedKernelSetting(f"cp_comm_type={kind!r} is not supported by the adapter's context-parallel "
                                       "attention: use 'p2p' (ring) or 'a2a' (Ulysses)")
    if kind == "a2a" and (heads % cp or groups % cp):
        raise UnsupportedKernelSetting(
            f"cp_comm_type='a2a' splits heads over the {cp} CP ranks, but this rank has {heads} query and {groups} "
            "key/value heads: use cp_comm_type='p2p', or a CP size dividing both")
    return kind


def arguments_refusal(args) -> str | None:
    """What of Megatron-LM's arguments (validated ``args``) this CP attention cannot run, in their flags, or
    None: a ``--cp-comm-type`` other than ``COMM_TYPES``, Ulysses over heads CP does not divide, attention
    dropout. The attention itself refuses them only as the model is built or in the first forward, on every
    rank; said from the arguments, the job gets one line before any model exists."""
    cp = args.context_parallel_size
    kinds = args.cp_comm_type if isinstance(args.cp_comm_type, (list, tuple)) else [args.cp_comm_type]
    kinds = [kind or "p2p" for kind in kinds]
    unsupported = [kind for kind in kinds if kind not in COMM_TYPES]
    if unsupported:
        return (f"--cp-comm-type {' '.join(kinds)}: the adapter's context-parallel attention runs p2p (ring) and "
                "a2a (Ulysses): use those")
    tp = args.tensor_model_parallel_size
    heads = args.num_attention_heads // tp
    groups = (args.num_query_groups if args.group_query_attention else args.num_attention_heads) // tp
    if "a2a" in kinds and (heads % cp or groups % cp):
        return (f"--cp-comm-type a2a with --context-parallel-size {cp}: Ulysses spreads each TP rank's {heads} "
                f"attention heads and {groups} query groups over the CP ranks, which {cp} does not divide: use "
                "--cp-comm-type p2p, or a CP size dividing both")
    if args.attention_dropout:
        return (f"--attention-dropout {args.attention_dropout} with --context-parallel-size {cp}: the adapter's "
                "context-parallel attention has no attention dropout: pass --attention-dropout 0")
    return None


# ---------------------------------------------------------------------------------------------------------
# ring attention (p2p)

def _shift(tensor: torch.Tensor, group) -> tuple[list, torch.Tensor]:
    """Start sending ``tensor`` to the next CP rank and receiving the previous rank's into a new buffer."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    received = torch.empty_like(tensor)
    ops = [dist.P2POp(dist.isend, tensor, dist.get_global_rank(group, (rank + 1) % size), group),
           dist.P2POp(dist.irecv, received, dist.get_global_rank(group, (rank - 1) % size), group)]
    return dist.batch_isend_irecv(ops), received


def _received(pending: tuple[list, torch.Tensor]) -> torch.Tensor:
    requests, received = pending
    for request in requests:
        request.wait()
    return received


def _block(src: int, rank: int, keys: int) -> tuple[slice, slice, bool]:
    """(query rows, key rows, causal) rank ``rank`` attends to of the K/V block of rank ``src``."""
    half = keys // 2
    if src == rank:
        return slice(None), slice(None), True
    if src < rank:
        return slice(None), slice(0, half), False
    return slice(half, None), slice(None), False


def merge_with_lse(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor):
    """Two partial attentions of the same rows over disjoint keys as one: (out, lse) of them together. The
    providers' default merge (adapter.kernels.provider); a provider may have its own (the npu provider's
    npu_ring_attention_update)."""
    new_lse = torch.logaddexp(lse, block_lse)
    return (out * torch.exp(lse - new_lse).unsqueeze(-1)
            + block_out.to(out.dtype) * torch.exp(block_lse - new_lse).unsqueeze(-1)), new_lse


class RingAttention(torch.autograd.Function):
    """q [b, nq, s, d], k/v [b, nkv, s, d] (this rank's two chunks) -> out [b, nq, s, d]."""

    @staticmethod
    def forward(ctx, q, k, v, scale, group, kernels):
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], -torch.inf, dtype=torch.float32, device=q.device)
        kv, merge = torch.stack([k, v]), kernels.merge_with_lse
        ctx.saved_by_step = []  # what each step's kernel keeps for its backward (tiny: lengths, RNG state)
        for step in range(cp):
            pending = _shift(kv, group) if step < cp - 1 else None
            rows, keys, causal = _block((rank - step) % cp, rank, k.shape[2])
            block_out, block_lse, saved = kernels.attention_with_lse(
                q[:, :, rows], kv[0][:, :, keys], kv[1][:, :, keys], scale=scale, causal=causal)
            out[:, :, rows], lse[:, :, rows] = merge(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
            ctx.saved_by_step.append(saved)
            kv = _received(pending) if pending else kv
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.group, ctx.kernels = scale, group, kernels
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, cp, rank = ctx.group, dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
        for step in range(cp):
            pending = _shift(kv, group) if step < cp - 1 else None
            rows, keys, causal = _block((rank - step) % cp, rank, k.shape[2])
            gq, gk, gv = ctx.kernels.attention_grad_from_lse(
                dout[:, :, rows], q[:, :, rows], kv[0][:, :, keys], kv[1][:, :, keys], out[:, :, rows],
                lse[:, :, rows], scale=ctx.scale, causal=causal, saved=ctx.saved_by_step[step])
            dq[:, :, rows] += gq
            dkv[0][:, :, keys] += gk
            dkv[1][:, :, keys] += gv
            dkv = _received(_shift(dkv, group))  # to the next rank, with the block it belongs to
            kv = _received(pending) if pending else kv
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def ring_attention(q, k, v, *, scale: float, group, kernels) -> torch.Tensor:
    """megatron's sbhd layout: q [s, b, nq, d], k/v [s, b, nkv, d] -> [s, b, nq * d]."""
    bhsd = [t.permute(1, 2, 0, 3).contiguous() for t in (q, k, v)]
    out = RingAttention.apply(*bhsd, scale, group, kernels)
    return out.permute(2, 0, 1, 3).flatten(2)


# ---------------------------------------------------------------------------------------------------------
# Ulysses (a2a)

def _all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split ``x`` into CP parts along ``scatter_dim``, send part j to CP rank j, and concatenate what each
    rank sent along ``gather_dim`` (in rank order)."""
    cp = dist.get_world_size(group)
    send = torch.stack(x.chunk(cp, dim=scatter_dim)).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class AllToAll(torch.autograd.Function):
    """``_all_to_all`` whose gradient is the all-to-all back."""

    @staticmethod
    def forward(ctx, x, group, scatter_dim: int, gather_dim: int):
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad.contiguous(), ctx.group, gather_dim, scatter_dim), None, None, None


def _positional_order(cp: int, length: int, device) -> torch.Tensor:
    """Where each position of the whole sequence sits after the all-to-all, which concatenates the ranks'
    local sequences (rank r: chunks r and 2CP-1-r)."""
    chunk = length // (2 * cp)
    chunks = [c for r in range(cp) for c in (r, 2 * cp - 1 - r)]
    gathered = torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in chunks])
    return torch.argsort(gathered)


def ulysses_attention(q, k, v, *, group, attention, **kwargs) -> torch.Tensor:
    """megatron's sbhd layout: q [s, b, nq, d], k [s, b, nkv, d], v [s, b, nkv, dv] -> [s, b, nq * dv];
    ``attention`` is the provider's, run on this rank's heads over the whole sequence in position order."""
    cp = dist.get_world_size(group)
    whole = [AllToAll.apply(t, group, 2, 0) for t in (q, k, v)]
    order = _positional_order(cp, whole[0].shape[0], q.device)
    out = attention(*(t[order] for t in whole), **kwargs)
    out = out.view(out.shape[0], out.shape[1], -1, v.shape[-1])[torch.argsort(order)]
    return AllToAll.apply(out, group, 0, 2).flatten(2)

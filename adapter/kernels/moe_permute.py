"""MoE token permutation for ``moe_permute_fusion`` in plain PyTorch, with Transformer Engine's interface
(the names megatron's ``moe_utils`` imports as ``fused_permute`` & co.).

Permuting groups the tokens by expert: rows come expert-major, tokens ascending within an expert,
exactly the order of megatron's unfused ``permute``, so the experts see the same rows either way. The
row map handed back (and given to ``unpermute``) is this provider's own: a [2, rows] int64 tensor of
each permuted row's (token, expert). megatron's dispatchers only carry it from permute to unpermute, so
its form is the provider's business; keeping the expert lets unpermute weight rows by ``merging_probs``
[tokens, experts] without the routing map, as TE's does.

Compared with megatron's unfused code this makes one ``nonzero`` over the transposed routing map instead
of expanding a [experts, tokens] index table, and gathers the probs by index.
"""

from __future__ import annotations

import torch

from adapter.kernels import UnsupportedKernelSetting


def row_map(routing_map: torch.Tensor) -> torch.Tensor:
    """(token, expert) of every routed pair, expert-major and token-ascending: [2, rows]."""
    expert, token = routing_map.T.nonzero(as_tuple=True)
    return torch.stack((token, expert))


def _check_count(rows: torch.Tensor, num_out_tokens) -> None:
    if num_out_tokens is not None and num_out_tokens > 0 and int(num_out_tokens) != rows.shape[1]:
        raise UnsupportedKernelSetting(
            f"num_out_tokens={int(num_out_tokens)} but the routing map routes {rows.shape[1]} token copies: "
            "the fused permutation keeps every routed pair (drop tokens in the routing map, as megatron's "
            "capacity factor does)")


def fused_permute(tokens, routing_map, num_out_tokens=None, max_token_num=-1, map_type="mask"):
    """Tokens grouped by expert, and the row map for ``fused_unpermute``."""
    rows = row_map(routing_map)
    _check_count(rows, num_out_tokens)
    return tokens.index_select(0, rows[0]), rows


def fused_permute_with_probs(tokens, probs, routing_map, num_out_tokens=None):
    """As ``fused_permute``, and each row's routing prob (probs[token, expert])."""
    rows = row_map(routing_map)
    _check_count(rows, num_out_tokens)
    return tokens.index_select(0, rows[0]), probs[rows[0], rows[1]], rows


def fused_unpermute(permuted, row_id_map, merging_probs=None, restore_shape=None, map_type="mask",
                    probs=None):
    """Every token's rows summed back into its place, each weighted by ``merging_probs[token, expert]``
    when given; in the rows' dtype."""
    if restore_shape is None:
        raise UnsupportedKernelSetting("fused_unpermute needs restore_shape (megatron always passes it)")
    rows = permuted
    if merging_probs is not None:
        rows = rows * merging_probs[row_id_map[0], row_id_map[1]].unsqueeze(-1).to(rows.dtype)
    out = torch.zeros(restore_shape, dtype=rows.dtype, device=rows.device)
    return out.index_add(0, row_id_map[0], rows)


def fused_sort_chunks_by_index(chunks, split_sizes, sorted_idxs):
    """The chunks of ``split_sizes`` rows, reordered as ``sorted_idxs`` lists them."""
    pieces = chunks.split(split_sizes.tolist())
    return torch.cat([pieces[i] for i in sorted_idxs.tolist()])


def fused_sort_chunks_by_index_with_probs(chunks, probs, split_sizes, sorted_idxs):
    """As ``fused_sort_chunks_by_index``, for the rows and their probs alike."""
    return (fused_sort_chunks_by_index(chunks, split_sizes, sorted_idxs),
            fused_sort_chunks_by_index(probs, split_sizes, sorted_idxs))

"""MoE token permutation for ``moe_permute_fusion`` in plain PyTorch, with Transformer Engine's interface
(the names megatron's ``moe_utils`` imports as ``fused_permute`` & co.).

Permuting groups the tokens by expert: rows come expert-major, tokens ascending within an expert,
exactly the order of megatron's unfused ``permute``, so the experts see the same rows either way. The
row map handed back (and given to ``unpermute``) is this provider's own: a [2, rows] int64 tensor of
each permuted row's (token, expert). megatron's dispatchers only carry it from permute to unpermute, so
its form is the provider's business; keeping the expert lets unpermute weight rows by ``merging_probs``
[tokens, experts] without the routing map, as TE's does.

No host sync on a device (GPU issue 26): megatron passes the number of routed pairs as ``num_out_tokens``
(tokens x topk without token dropping, a count it copied to the host itself otherwise), so the rows come
from a stable sort of the expert-major map, whose output size is that count, where megatron's unfused code
``masked_select``s (output size read back from the device). The chunk sort of the all-to-all dispatcher
gathers by a row index computed on the device where megatron's splits on host copies of sizes and order.
The count is taken on trust, as TE's permutation takes it: megatron computes it from the same map.
"""

from __future__ import annotations

import torch

from adapter.kernels import UnsupportedKernelSetting


def _host_count(num_out_tokens) -> int | None:
    """``num_out_tokens`` as an int when reading it costs no device sync (a Python int, or a tensor
    megatron already copied to the host) and it names a count (TE's -1 / None: "all routed pairs")."""
    if isinstance(num_out_tokens, torch.Tensor) and num_out_tokens.device.type != "cpu":
        return None
    count = None if num_out_tokens is None else int(num_out_tokens)
    return count if count is not None and count > 0 else None


def row_map(routing_map: torch.Tensor, num_out_tokens=None) -> torch.Tensor:
    """(token, expert) of every routed pair, expert-major and token-ascending: [2, rows]. With a host
    count the routed pairs sort first (stable: tokens stay ascending) into a tensor of static size;
    without, ``nonzero`` finds them (its size read back from the device: a sync there)."""
    count = _host_count(num_out_tokens)
    if count is None:
        expert, token = routing_map.T.nonzero(as_tuple=True)
        return torch.stack((token, expert))
    tokens = routing_map.shape[0]
    pairs = routing_map.T.reshape(-1).to(torch.int8).argsort(descending=True, stable=True)[:count]
    return torch.stack((pairs % tokens, pairs.div(tokens, rounding_mode="floor")))


def fused_permute(tokens, routing_map, num_out_tokens=None, max_token_num=-1, map_type="mask"):
    """Tokens grouped by expert, and the row map for ``fused_unpermute``."""
    rows = row_map(routing_map, num_out_tokens)
    return tokens.index_select(0, rows[0]), rows


def fused_permute_with_probs(tokens, probs, routing_map, num_out_tokens=None):
    """As ``fused_permute``, and each row's routing prob (probs[token, expert])."""
    rows = row_map(routing_map, num_out_tokens)
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


def chunk_rows(split_sizes: torch.Tensor, sorted_idxs: torch.Tensor, rows: int) -> torch.Tensor:
    """The input row of each of the ``rows`` output rows when the chunks of ``split_sizes`` rows are laid
    out in the order ``sorted_idxs`` lists them: computed where the sizes are, so sorting reads neither
    sizes nor order on the host."""
    sizes = split_sizes.index_select(0, sorted_idxs)  # the output's chunks
    ends = sizes.cumsum(0)
    shift = (split_sizes.cumsum(0) - split_sizes).index_select(0, sorted_idxs) - (ends - sizes)
    out = torch.arange(rows, device=split_sizes.device)
    return out + shift[torch.searchsorted(ends, out, right=True)]


def fused_sort_chunks_by_index(chunks, split_sizes, sorted_idxs):
    """The chunks of ``split_sizes`` rows, reordered as ``sorted_idxs`` lists them."""
    index = chunk_rows(split_sizes.to(chunks.device), sorted_idxs.to(chunks.device), chunks.shape[0])
    return chunks.index_select(0, index)


def fused_sort_chunks_by_index_with_probs(chunks, probs, split_sizes, sorted_idxs):
    """As ``fused_sort_chunks_by_index``, for the rows and their probs alike (one row index for both)."""
    index = chunk_rows(split_sizes.to(chunks.device), sorted_idxs.to(chunks.device), chunks.shape[0])
    return chunks.index_select(0, index), probs.index_select(0, index)

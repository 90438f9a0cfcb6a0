"""MoE token permutation for ``moe_permute_fusion`` on torch_npu's fused ops, with Transformer Engine's
interface (the names megatron's ``moe_utils`` imports as ``fused_permute`` & co.).

The index form (``npu_moe_token_permute`` / ``npu_moe_token_unpermute``) is the one torch_npu documents
with backward nodes, so gradients need no code here. It takes each token's k expert ids ([T, k]) and
sorts the copies by expert, ties by token: megatron's expert-major, token-ascending order. Its
``sorted_indices`` (int32, one per copy, the inverse permutation) is the row map megatron carries to
unpermute, which reads k back as len(sorted_indices) / T.

The op needs the same k for every token. A top-k router without token dropping gives exactly that (the
alltoall dispatcher's map); a map with rows of other counts (the allgather dispatcher's local experts,
capacity-dropped tokens) takes the torch permutation, whose 2-D row map unpermute tells apart.
"""

from __future__ import annotations

import torch
import torch_npu

from adapter.kernels import UnsupportedKernelSetting, moe_permute


def _topk_ids(routing_map: torch.Tensor) -> torch.Tensor | None:
    """[T, k] expert ids, ascending per token, when every token has the same k > 0 experts; else None."""
    counts = routing_map.sum(dim=1)
    topk = int(counts[0]) if counts.numel() else 0
    if topk == 0 or not bool((counts == topk).all()):
        return None
    return routing_map.nonzero()[:, 1].view(-1, topk)


def fused_permute(tokens, routing_map, num_out_tokens=None, max_token_num=-1, map_type="mask"):
    ids = _topk_ids(routing_map)
    if ids is None:
        return moe_permute.fused_permute(tokens, routing_map, num_out_tokens)
    return torch_npu.npu_moe_token_permute(tokens, ids.to(torch.int32))


def fused_permute_with_probs(tokens, probs, routing_map, num_out_tokens=None):
    """As ``fused_permute``, and each copy's routing prob in megatron's order (probs keep their dtype: the
    router's, often float32 under bf16 tokens)."""
    ids = _topk_ids(routing_map)
    if ids is None:
        return moe_permute.fused_permute_with_probs(tokens, probs, routing_map, num_out_tokens)
    permuted, sorted_indices = torch_npu.npu_moe_token_permute(tokens, ids.to(torch.int32))
    return permuted, probs.T.masked_select(routing_map.T.bool()), sorted_indices


def fused_unpermute(permuted, row_id_map, merging_probs=None, restore_shape=None, map_type="mask",
                    probs=None):
    if row_id_map.dim() == 2:  # the torch permutation's (token, expert) rows
        return moe_permute.fused_unpermute(permuted, row_id_map, merging_probs, restore_shape)
    if merging_probs is not None:
        raise UnsupportedKernelSetting(
            "fused unpermute with merging probs on the npu provider: its row map keeps no expert ids. "
            "megatron's dispatchers apply the probs in the experts instead; set ADAPTER_KERNELS=torch for "
            "code that merges here")
    if restore_shape is None:
        raise UnsupportedKernelSetting("fused_unpermute needs restore_shape (megatron always passes it)")
    # the op sums k copies per token only as weights [T, k] (without, it takes k = 1): weights of one
    tokens = restore_shape[0]
    ones = torch.ones(tokens, row_id_map.numel() // tokens, dtype=permuted.dtype, device=permuted.device)
    return torch_npu.npu_moe_token_unpermute(permuted, row_id_map, probs=ones, restore_shape=restore_shape)


fused_sort_chunks_by_index = moe_permute.fused_sort_chunks_by_index  # torch_npu documents no such op
fused_sort_chunks_by_index_with_probs = moe_permute.fused_sort_chunks_by_index_with_probs

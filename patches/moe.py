"""Mixture-of-Experts on every backend (issue 15): what megatron-core's MoE code needs beyond CUDA.

``moe_utils`` imports ``te_general_gemm`` with Transformer Engine's fused MoE ops inside ``try: ...``; its
``except ImportError`` branch never binds the name, although ``RouterGatingLinearFunction`` (every
router's gating GEMM) asks ``te_general_gemm is not None`` before falling back to ``torch.mm``. Without
TE (CPU, Ascend, CUDA without TE) every MoE router raises ``NameError``; bound to None, it takes the
fallback megatron wrote for that case.

With tensor parallelism the all-to-all dispatcher gathers each TP rank's tokens for its experts, as many as the
router sent there, so the ranks' pieces differ in length: ``mappings._gather_along_first_dim`` with
``output_split_sizes`` (and its backward, for ``reduce_scatter`` with ``input_split_sizes``) hands
``torch.distributed.all_gather`` unequal tensors, which NCCL and HCCL gather and gloo refuses ("invalid tensor
size"). On cpu those gathers go through gloo's equal-size gather, each piece padded to the longest.

With one TP x EP rank the all-to-all dispatcher still sorts its chunks by local expert before and after the
experts (``num_local_experts > 1`` is its only condition), in an order that is then the identity: a copy of
every routed row forward and backward, twice per layer, for nothing. The dispatcher keeps no order at that
size (None), and ``sort_chunks_by_idxs`` takes None as "the rows as they are".
"""

import torch

_MOE_UTILS = "megatron.core.transformer.moe.moe_utils"
_MAPPINGS = "megatron.core.tensor_parallel.mappings"
_DISPATCHER = "megatron.core.transformer.moe.token_dispatcher"


def _gather_unequal_pieces_padded(gather):
    """``_gather_along_first_dim`` whose unequal ``output_split_sizes`` reach the collective as equal pieces:
    each rank's input padded to the longest piece, gathered, and every piece cut back to its own length."""

    def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or len(set(output_split_sizes)) == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        longest = max(output_split_sizes)
        padded = input_.new_zeros((longest, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        pieces = gather(padded, group).split(longest)
        return torch.cat([piece[:size] for piece, size in zip(pieces, output_split_sizes)])

    return _gather_along_first_dim


def _no_identity_chunk_orders(init):
    """The all-to-all dispatcher's ``__init__``, leaving its chunk orders None where they are the identity
    (one TP x EP rank: the chunks are the local experts, already in order)."""

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if self.tp_size * self.ep_size == 1:
            self.sort_input_by_local_experts = self.restore_output_by_local_experts = None

    return __init__


def _none_order_keeps_rows(sort):
    """``sort_chunks_by_idxs`` that hands the rows (and probs) back as they are for a None order."""

    def sort_chunks_by_idxs(input, split_sizes, sorted_idxs, probs=None, fused=False):
        if sorted_idxs is None:
            return input, probs
        return sort(input, split_sizes, sorted_idxs, probs=probs, fused=fused)

    return sort_chunks_by_idxs


def register(registry, versions: str) -> None:
    registry.bind(f"{_MOE_UTILS}:te_general_gemm", None, versions=versions,
                  reason="unbound without Transformer Engine; the router's gating GEMM falls back to torch.mm on None")
    registry.wrap(f"{_MAPPINGS}:_gather_along_first_dim", _gather_unequal_pieces_padded, versions=versions,
                  backends=("cpu",), reason="gathers pieces of unequal length, which gloo's all_gather refuses")
    registry.wrap(f"{_DISPATCHER}:MoEAlltoAllTokenDispatcher.__init__", _no_identity_chunk_orders, versions=versions,
                  reason="at one TP x EP rank the chunk sort by local expert is the identity: no order, no copy")
    registry.wrap(f"{_DISPATCHER}:sort_chunks_by_idxs", _none_order_keeps_rows, versions=versions,
                  reason="the dispatcher's identity chunk orders are None: the rows stay as they are")

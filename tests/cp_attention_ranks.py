"""Rank functions for the context-parallel attention tests: the adapter's core attention over a CP group of
real gloo ranks against the same provider's attention over the whole sequence on one rank."""

from __future__ import annotations

import adapter  # noqa: F401 - before megatron
import torch
from megatron.core import parallel_state
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnMaskType

from adapter import kernels


def _whole(seq: int, heads: int, groups: int, d: int = 8, batch: int = 2, dv: int | None = None):
    """q, k, v and the output gradient of one sequence, the same on every rank; value heads of ``dv``
    (multi-latent attention's narrower ones), default d."""
    g = torch.Generator().manual_seed(seq * 100 + heads * 10 + groups)
    dv = dv or d
    q = torch.randn(seq, batch, heads, d, generator=g)
    k, v = (torch.randn(seq, batch, groups, size, generator=g) for size in (d, dv))
    return q, k, v, torch.randn(seq, batch, heads * dv, generator=g)


def _module(kind: str, heads: int, groups: int, d: int, cp: int, provider, dv: int | None = None):
    config = TransformerConfig(num_layers=1, hidden_size=heads * d, num_attention_heads=heads, num_query_groups=groups,
                               kv_channels=d, context_parallel_size=cp, cp_comm_type=kind, attention_dropout=0.0,
                               hidden_dropout=0.0, cuda_graph_scope=[])
    return kernels.core_attention_module(provider)(config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                                   attention_type="self", k_channels=d, v_channels=dv or d)


def _this_ranks_chunks(seq: int, cp: int, rank: int) -> torch.Tensor:
    """megatron's load-balanced split: chunks rank and 2CP-1-rank of 2CP."""
    chunk = seq // (2 * cp)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in (rank, 2 * cp - 1 - rank)])


NPU_OPS = ("npu_fusion_attention", "npu_fusion_attention_grad", "npu_ring_attention_update")


def _npu_calls() -> list[int]:
    """How often the torch_npu double's attention ops ran in this process (zeros without the double)."""
    import sys

    calls = getattr(sys.modules.get("torch_npu"), "CALLS", {})
    return [calls.get(op, 0) for op in NPU_OPS]


def _max_differences(kind: str, seq: int, heads: int, groups: int, provider, d: int = 8,
                     dv: int | None = None) -> list[float]:
    """max |CP - whole| of the output and of the q, k, v gradients on this rank's chunks, then how often
    the CP attention called each of NPU_OPS."""
    cp, rank = parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank()
    q, k, v, dout = _whole(seq, heads, groups, d, dv=dv)
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    reference = _module(kind, heads, groups, d, 1, provider, dv)  # CP 1: the provider's attention, whole sequence
    reference.cp_group = None
    out = reference(*whole, None)
    out.backward(dout)
    mine = _this_ranks_chunks(seq, cp, rank)
    local = [t[mine].clone().requires_grad_() for t in (q, k, v)]
    before = _npu_calls()
    local_out = _module(kind, heads, groups, d, cp, provider, dv)(*local, None)
    local_out.backward(dout[mine])
    return [(local_out - out[mine]).abs().max().item()] + [
        (part.grad - full.grad[mine]).abs().max().item() for part, full in zip(local, whole)] + [
        after - start for start, after in zip(before, _npu_calls())]


def cp_attention_differences(cases: list[tuple], provider_name: str) -> list[list[float]]:
    """Each case (kind, seq, heads, groups[, value head size]): the differences ``_max_differences`` gives,
    on a CP group of every rank."""
    adapter.init_distributed()
    parallel_state.initialize_model_parallel(context_parallel_size=torch.distributed.get_world_size())
    provider = kernels.select_provider(provider_name)
    out = [_max_differences(kind, seq, heads, groups, provider, dv=dv[0] if dv else None)
           for kind, seq, heads, groups, *dv in cases]
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    return out

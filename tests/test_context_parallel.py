"""Context-parallel core attention (adapter/kernels/context_parallel.py) on real gloo ranks: over megatron's
load-balanced split, the ring (p2p) and Ulysses (a2a) give each rank the output and the q, k, v gradients of
attention over the whole sequence, with GQA, at CP 2 and CP 4; what cannot run is refused by name."""

from __future__ import annotations

import pytest

from adapter.kernels import UnsupportedKernelSetting, context_parallel
from tests.conftest import DOUBLES
from tests.cp_attention_ranks import cp_attention_differences
from tests.distributed import run_ranks

# (cp_comm_type, sequence, query heads, key/value heads): MHA, GQA 2:1 and 4:1 (one group: a2a cannot split
# it), sequences whose chunks differ in causal work (chunk 0 sees itself, chunk 2CP-1 everything)
# The last: Ulysses with value heads narrower than the query/key ones (multi-latent attention's 6 vs 8).
CP2_CASES = [("p2p", 24, 4, 4), ("p2p", 40, 4, 2), ("p2p", 16, 4, 1), ("a2a", 24, 4, 4), ("a2a", 40, 4, 2),
             ("a2a", 24, 4, 2, 6)]
CP4_CASES = [("p2p", 32, 4, 2), ("a2a", 48, 8, 4)]


@pytest.mark.multiproc
@pytest.mark.parametrize("world, cases", [(2, CP2_CASES), pytest.param(4, CP4_CASES, marks=pytest.mark.slow)],
                         ids=["cp2", "cp4"])
def test_cp_attention_equals_attention_over_the_whole_sequence(world, cases):
    per_rank = run_ranks(world, cp_attention_differences, cases, "torch")
    for rank, differences in enumerate(per_rank):
        for case, (out, dq, dk, dv, *_) in zip(cases, differences):
            assert max(out, dq, dk, dv) < 1e-5, (rank, case, out, dq, dk, dv)


@pytest.mark.multiproc
def test_the_npu_provider_runs_cp_attention_on_the_npu_ops():
    """Through the torch_npu double: the ring's blocks on npu_fusion_attention (and its grad), merged by
    npu_ring_attention_update, one of each per ring step; Ulysses on npu_fusion_attention."""
    cases = [("p2p", 24, 4, 2), ("a2a", 24, 4, 2)]
    per_rank = run_ranks(2, cp_attention_differences, cases, "npu", env={"ADAPTER_KERNELS": "npu",
                                                                          "PYTHONPATH": str(DOUBLES)})
    for differences in per_rank:
        (*ring, forward, backward, merges), (*ulysses, a2a_forward, a2a_backward, a2a_merges) = differences
        assert max(ring) < 1e-5 and max(ulysses) < 1e-5, differences
        assert (forward, backward, merges) == (2, 2, 2)  # CP 2: two ring steps
        assert (a2a_forward, a2a_backward, a2a_merges) == (1, 0, 0)  # autograd differentiates the forward


@pytest.mark.parametrize("kind, heads, groups, message", [
    ("allgather", 4, 4, "cp_comm_type='allgather' is not supported"),
    ("a2a+p2p", 4, 4, "cp_comm_type='a2a\\+p2p' is not supported"),
    ("a2a", 4, 1, "has 4 query and 1 key/value heads: use cp_comm_type='p2p'"),
    ("a2a", 6, 2, "has 6 query and 2 key/value heads"),
])
def test_what_cp_attention_cannot_run_is_refused_by_name(kind, heads, groups, message):
    with pytest.raises(UnsupportedKernelSetting, match=message):
        context_parallel.check_cp_attention(kind, heads, groups, 4)
    assert context_parallel.check_cp_attention(["p2p"], heads, groups, 4) == "p2p"


@pytest.mark.parametrize("what, message", [
    ("thd", "packed \\(thd\\) sequences with context_parallel_size=2"),
    ("mask", "an attention mask with context_parallel_size=2"),
    ("dropout", "attention dropout 0.1 with context_parallel_size=2"),
])
def test_what_the_cp_attention_does_not_cover_is_refused_before_any_communication(what, message):
    """Packed sequences (megatron's THD split with cu_seqlens_*_padded), masks and dropout under CP: one
    line naming them, before a rank waits on another."""
    import types

    import torch
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from adapter import kernels

    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, context_parallel_size=2,
                               attention_dropout=0.1 if what == "dropout" else 0.0, cuda_graph_scope=[])
    mask_type = AttnMaskType.padding_causal if what == "mask" else AttnMaskType.causal
    module = kernels.core_attention_module(kernels.select_provider("torch"))(
        config, layer_number=1, attn_mask_type=mask_type, attention_type="self",
        pg_collection=types.SimpleNamespace(cp="a CP group never used"))
    q = torch.randn(8, 1, 4, 8)
    mask = torch.zeros(1, 1, 8, 8, dtype=torch.bool) if what == "mask" else None
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                             cu_seqlens_kv_padded=cu) if what == "thd" else None
    with pytest.raises(UnsupportedKernelSetting, match=message):
        module(q, q, q, mask, packed_seq_params=packed)


@pytest.mark.cuda
def test_the_cuda_providers_ring_blocks_on_sdpas_flash_kernel_equal_the_math():
    """On a GPU in bf16: the cuda provider's blocks (SDPA's flash kernel with its log-sum-exp, and its
    backward fed the global statistics) against the torch provider's math on the same tensors."""
    import torch

    from adapter.kernels import cuda_provider, torch_provider

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 8, 256, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(2, 2, 256, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    dout = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16, generator=g)
    for causal in (True, False):
        out, lse, saved = cuda_provider.attention_with_lse(q, k, v, scale=0.125, causal=causal)
        ref_out, ref_lse, _ = torch_provider.attention_with_lse(q, k, v, scale=0.125, causal=causal)
        torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse, ref_lse, atol=1e-2, rtol=1e-3)
        grads = cuda_provider.attention_grad_from_lse(dout, q, k, v, ref_out, ref_lse, scale=0.125, causal=causal,
                                                      saved=saved)
        reference = torch_provider.attention_grad_from_lse(dout, q, k, v, ref_out, ref_lse, scale=0.125, causal=causal)
        for ours, theirs in zip(grads, reference):
            assert ours.shape == theirs.shape
            torch.testing.assert_close(ours.float(), theirs.float(), atol=5e-2, rtol=5e-2)

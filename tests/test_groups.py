"""megatron's process-group layout matches megatron's docs.

Default order tp-cp-ep-dp-pp: tensor-parallel neighbours are adjacent ranks, data parallel strides over
TP, pipeline stages stride over TP x DP. The expected groups are written out literally, not computed.
Built by real ranks on the adapter's backend (gloo here) for 4 ranks; the 8- and 16-rank layouts are
megatron's arithmetic alone, so they are built rank by rank in this process over torch's fake process
group (a real 16-rank world on 2 cores spent 80 s creating gloo groups to check the same tables).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_ranks


def build_groups(tp: int, pp: int, cp: int = 1, ep: int = 1) -> dict:
    import adapter
    from megatron.core import parallel_state as ps

    adapter.init_distributed()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 context_parallel_size=cp, expert_model_parallel_size=ep)
    result = _layout(ps)
    torch.distributed.barrier()  # rank 0 hosts the store: nobody leaves while others build groups
    torch.distributed.destroy_process_group()
    return result


def _layout(ps) -> dict:
    ranks = torch.distributed.get_process_group_ranks
    return {
        "rank": torch.distributed.get_rank(),
        "backend": torch.distributed.get_backend(),
        "tp": ranks(ps.get_tensor_model_parallel_group()),
        "pp": ranks(ps.get_pipeline_model_parallel_group()),
        "dp": ranks(ps.get_data_parallel_group()),
        "embd": ranks(ps.get_embedding_group()) if ps.is_rank_in_embedding_group() else None,
        "cp": ranks(ps.get_context_parallel_group()),
        "dp_cp": ranks(ps.get_data_parallel_group(with_context_parallel=True)),
        "ep": ranks(ps.get_expert_model_parallel_group()),
        "edp": ranks(ps.get_expert_data_parallel_group()),
    }


def layouts_in_a_fake_world(world: int, tp: int, pp: int) -> list[dict]:
    """Each rank's groups as megatron builds them, one rank at a time over torch's fake process group."""
    from megatron.core import parallel_state as ps
    from torch.testing._internal.distributed.fake_pg import FakeStore

    results = []
    for rank in range(world):
        torch.distributed.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                         create_gloo_process_groups=False)
            results.append(_layout(ps))
        finally:
            ps.destroy_model_parallel()
            torch.distributed.destroy_process_group()
    return results


def _group_of(rank: int, groups: list[list[int]]) -> list[int]:
    (group,) = [g for g in groups if rank in g]
    return group


def _check(results: list[dict], world: int, expected: dict, backend: str = "gloo") -> None:
    assert [r["rank"] for r in results] == list(range(world))
    assert {r["backend"] for r in results} == {backend}
    for kind, groups in expected.items():
        # the literal tables partition the world exactly once
        assert sorted(r for g in groups for r in g) == list(range(world)), kind
        for r in results:
            got = r[kind]
            if kind == "embd" and got is None:
                assert all(r["rank"] not in g for g in groups), r
                continue
            assert got == _group_of(r["rank"], groups), (kind, r["rank"], got)
        seen = sorted({tuple(r[kind]) for r in results if r[kind] is not None})
        assert seen == sorted(tuple(g) for g in groups), kind


def test_tp2_pp2_dp2_on_8_ranks():
    expected = {
        "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "embd": [[0, 4], [1, 5], [2, 6], [3, 7]],  # first and last stage: with PP2, the PP groups
    }
    _check(layouts_in_a_fake_world(8, 2, 2), 8, expected, backend="fake")


def test_tp2_pp4_dp2_on_16_ranks():
    expected = {
        "tp": [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]],
        "pp": [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]],
        "dp": [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]],
    }
    results = layouts_in_a_fake_world(16, 2, 4)
    _check(results, 16, expected, backend="fake")
    # embedding group: first and last pipeline stage only; middle stages (ranks 4-11) are outside it
    embd = [[0, 12], [1, 13], [2, 14], [3, 15]]
    for r in results:
        if 4 <= r["rank"] <= 11:
            assert r["embd"] is None, r
        else:
            assert r["embd"] == _group_of(r["rank"], embd), r


@pytest.mark.multiproc
@pytest.mark.slow
def test_context_and_expert_parallel_on_4_ranks():
    """CP2 x DP2 for the dense layers; the experts re-split the same 4 ranks as EP2 x expert-DP2."""
    expected = {
        "tp": [[0], [1], [2], [3]],
        "cp": [[0, 1], [2, 3]],
        "dp": [[0, 2], [1, 3]],
        "dp_cp": [[0, 1, 2, 3]],
        "pp": [[0], [1], [2], [3]],
        "ep": [[0, 1], [2, 3]],
        "edp": [[0, 2], [1, 3]],
    }
    _check(run_ranks(4, build_groups, 1, 1, 2, 2), 4, expected)

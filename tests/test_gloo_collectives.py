"""Collectives gloo refuses in shapes NCCL accepts (patches/gloo_collectives.py), on real gloo ranks."""

from __future__ import annotations

import pytest

from tests.distributed import run_ranks

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]


def gather_2d_across_tp(tp: int) -> dict:
    import torch

    import adapter
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random, utils

    adapter.init_distributed()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    rank = torch.distributed.get_rank()
    mine = torch.arange(6.0).view(2, 3) + 100 * rank
    result = {"utils": utils.gather_split_1d_tensor(mine).tolist(),
              "random": random.gather_split_1d_tensor(mine.t()).tolist(),  # the copy random.py holds; strided
              "status": adapter.registry.status(f"{utils.__name__}:gather_split_1d_tensor")}
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return result


def test_gather_split_1d_tensor_of_a_2d_tensor_on_gloo():
    results = run_ranks(2, gather_2d_across_tp, 2)
    rows = [[0.0, 1.0, 2.0, 3.0, 4.0, 5.0], [100.0, 101.0, 102.0, 103.0, 104.0, 105.0]]
    transposed = [[r[i] for i in (0, 3, 1, 4, 2, 5)] for r in rows]  # mine.t() flattened, row-major
    for result in results:
        assert result["status"] == "applied"
        assert result["utils"] == rows[0] + rows[1]
        assert result["random"] == transposed[0] + transposed[1]


def gather_uneven_parts() -> dict:
    import torch
    from torch.distributed.tensor import DeviceMesh, Shard, distribute_tensor

    import adapter
    import megatron.core.optimizer.layer_wise_optimizer  # noqa: F401 - its patch goes in on import
    from megatron.core.distributed.fsdp.src.megatron_fsdp import uneven_dtensor
    from patches.gloo_collectives import _UNEVEN_GATHERS, AnySizeAllGather

    adapter.init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    # 7 rows over 3 ranks: torch's own sharding gives 3, 3 and 1 rows
    whole = torch.arange(21.0).view(7, 3)
    sharded = distribute_tensor(whole, DeviceMesh("cpu", list(range(world))), [Shard(0)])
    parts = [torch.full((r + 1,), -1.0) for r in range(world)]
    mine = torch.full((rank + 1,), float(rank))
    with AnySizeAllGather():
        torch.distributed.all_gather(parts, mine)
        handle = torch.distributed.all_gather(parts_async := [torch.empty(r + 1) for r in range(world)], mine,
                                              async_op=True)
        handle.wait()
    result = {"megatron": uneven_dtensor.gather_uneven_dtensor_to_full_tensor(sharded).to_local().tolist(),
              "parts": [p.tolist() for p in parts], "async": [p.tolist() for p in parts_async],
              "local_rows": sharded.to_local().shape[0],
              "status": {target: adapter.registry.status(target) for target, *_ in _UNEVEN_GATHERS}}
    torch.distributed.destroy_process_group()
    return result


def test_all_gather_of_unequal_sizes_on_gloo_as_nccl_runs_it():
    """torch documents all_gather of unequal sizes and NCCL runs it; megatron's Megatron-FSDP checkpoint
    gather and layer-wise optimizer rely on it. Gloo refuses it; under the adapter those functions get it."""
    import torch

    results = run_ranks(3, gather_uneven_parts)
    expected_parts = [[0.0], [1.0, 1.0], [2.0, 2.0, 2.0]]
    for result in results:
        assert [r["local_rows"] for r in results] == [3, 3, 1]  # the shards really are uneven
        assert result["megatron"] == torch.arange(21.0).view(7, 3).tolist()
        assert result["parts"] == expected_parts and result["async"] == expected_parts
        applied = [target for target, status in result["status"].items() if status == "applied"]
        assert any("uneven_dtensor" in t for t in applied) and any("allgather_params" in t for t in applied), (
            result["status"])

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

"""The suite's rank launcher (tests/distributed.py): forked ranks behave as fresh rank processes would."""

from __future__ import annotations

import os
import sys

import pytest

from tests.distributed import RankFailure, run_ranks

pytestmark = pytest.mark.multiproc


def describe_rank() -> dict:
    import torch.distributed as dist

    import adapter

    adapter.init_distributed()
    world = dist.get_world_size()
    dist.barrier()
    return {"pid": os.getpid(), "rank": int(os.environ["RANK"]), "world": world,
            "probe": os.environ.get("LAUNCHER_PROBE"), "backend": adapter.current_backend().name,
            "stdout": sys.stdout.fileno()}


def fail_on_rank_one() -> None:
    if os.environ["RANK"] == "1":
        raise ValueError("rank one says no")


def test_ranks_are_separate_processes_with_their_own_environment():
    results = run_ranks(2, describe_rank, env={"LAUNCHER_PROBE": "seen"})
    assert [r["rank"] for r in results] == [0, 1] and {r["world"] for r in results} == {2}
    assert len({r["pid"] for r in results} | {os.getpid()}) == 3
    assert {r["probe"] for r in results} == {"seen"} and {r["backend"] for r in results} == {"cpu"}


def test_a_failing_rank_raises_with_its_traceback():
    with pytest.raises(RankFailure, match="(?s)rank 1 of 2 failed.*ValueError: rank one says no"):
        run_ranks(2, fail_on_rank_one)

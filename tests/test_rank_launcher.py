"""The suite's rank launcher (tests/distributed.py): forked ranks behave as fresh rank processes would."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.distributed import RankFailure, run_ranks

DOUBLES = Path(__file__).resolve().parent / "doubles"

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


def parent_and_backend() -> dict:
    import adapter

    return {"parent": os.getppid(), "backend": adapter.current_backend().name}


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


# Imported at every interpreter's start-up from PYTHONPATH: an "npu" device that torch reports (as
# torch_npu registers it), so with the torch_npu double the adapter chooses a real accelerator backend
NPU_DEVICE_SITECUSTOMIZE = "import npu_device\nnpu_device.register()\n"


def test_only_cpu_ranks_are_forked_and_accelerator_ranks_start_fresh(tmp_path):
    """A process that chose a cuda or npu backend has asked the driver for its devices, and its forks
    cannot use the device: such ranks are fresh interpreters, children of the test process, while CPU
    ranks fork from the zygote. An npu device stand-in with the torch_npu double stands for any accelerator."""
    (tmp_path / "sitecustomize.py").write_text(NPU_DEVICE_SITECUSTOMIZE)
    cpu = run_ranks(2, parent_and_backend)
    npu = run_ranks(2, parent_and_backend, env={"ADAPTER_BACKEND": "npu",
                                                 "PYTHONPATH": os.pathsep.join([str(tmp_path), str(DOUBLES)])})
    assert {r["backend"] for r in cpu} == {"cpu"} and os.getpid() not in {r["parent"] for r in cpu}
    assert {r["backend"] for r in npu} == {"npu"} and {r["parent"] for r in npu} == {os.getpid()}

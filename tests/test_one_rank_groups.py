"""Process groups of one rank answered on the calling thread (adapter/one_rank_groups.py): every collective
gives what gloo's own one-rank group gives, call by call; megatron's layout gets them for its one-rank gloo
groups only; and the flow's curve is gloo's to the bit while gloo's worker threads start no OpenMP team of
their own, which would leave libgomp throttling the training thread's (the module's docstring)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from adapter import backend as adapter_backend
from tests.distributed import run_ranks

_ARGV = ["--model", "qwen2.5-tiny", "--micro-batch-size", "2", "--global-batch-size", "2", "--seq-length", "64",
         "--train-iters", "6", "--lr", "3e-3", "--lr-decay-style", "constant", "--mock-data", "--log-interval", "1",
         "--eval-interval", "1000", "--eval-iters", "0", "--hidden-dropout", "0", "--attention-dropout", "0",
         "--use-distributed-optimizer", "--seed", "7", "--save-interval", "3"]


@pytest.mark.parametrize("backend, ranks, asked, made", [
    ("cpu", [0], None, True), ("cpu", [0], "gloo", True), ("cpu", [0], "nccl", True),  # routed to gloo
    ("cpu", [0, 1], None, False), ("cpu", [0], "mpi", False),
    ("cuda", [0], "nccl", False), ("cuda", [0], "gloo", True), ("npu", [0], "hccl", False)])
def test_only_one_rank_gloo_groups_are_answered_here(monkeypatch, backend, ranks, asked, made):
    from adapter import one_rank_groups

    monkeypatch.setattr(adapter_backend, "current", lambda: adapter_backend.Backend(backend))
    monkeypatch.setattr(one_rank_groups.dist, "get_backend", lambda group=None: "gloo")  # the world's default
    monkeypatch.delenv(one_rank_groups.SETTING, raising=False)
    assert one_rank_groups.answers_here(ranks, asked) is made


@pytest.mark.parametrize("setting, backend, ranks, asked, made", [
    ("all", "cuda", [0], "nccl", True), ("all", "npu", [0], "hccl", True), ("all", "cpu", [0], "nccl", True),
    ("all", "cuda", [0], None, True),  # the world's default library: nccl on this world
    ("all", "cuda", [0, 1], "nccl", False), ("all", "cuda", [0], "mpi", False),
    ("none", "cpu", [0], None, False), ("none", "cuda", [0], "gloo", False), ("GLOO", "cuda", [0], "nccl", False)])
def test_the_setting_names_the_libraries_whose_one_rank_groups_are_answered_here(monkeypatch, setting, backend,
                                                                                   ranks, asked, made):
    from adapter import one_rank_groups

    monkeypatch.setattr(adapter_backend, "current", lambda: adapter_backend.Backend(backend))
    monkeypatch.setattr(one_rank_groups.dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setenv(one_rank_groups.SETTING, setting)
    assert one_rank_groups.answers_here(ranks, asked) is made


def test_an_unknown_setting_is_refused_at_import_naming_it_and_the_choices():
    done = subprocess.run([sys.executable, "-c", "import adapter"], capture_output=True, text=True,
                          env={**os.environ, "ADAPTER_ONE_RANK_GROUPS": "nccl"})
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1] == (
        "ValueError: ADAPTER_ONE_RANK_GROUPS='nccl': use gloo (the default: gloo's one-rank groups), all (NCCL's "
        "and HCCL's too) or none (every group left to its library)")


def _collectives(group) -> dict:
    """Each torch.distributed collective over ``group`` (one rank), and what came out of it."""
    import torch
    import torch.distributed as dist

    x = torch.arange(6.0).reshape(2, 3)
    out = {}
    for op in ("SUM", "AVG", "MAX", "MIN", "PRODUCT"):
        t = x.clone()
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op), group=group)
        out[f"all_reduce {op}"] = t
    t = x.clone()
    handle = dist.all_reduce(t, group=group, async_op=True)
    out["async handle"] = torch.tensor([handle.wait(), handle.is_completed()])
    out["async future"] = handle.get_future().wait()[0]
    t = x.clone()
    dist.broadcast(t, src=0, group=group)
    out["broadcast"] = t
    t = x.clone()
    dist.reduce(t, dst=0, group=group)
    out["reduce"] = t
    parts = [torch.zeros(2, 3)]
    dist.all_gather(parts, x, group=group)
    out["all_gather"] = parts[0]
    for shape in ((6,), (2, 3)):
        flat = torch.zeros(shape)
        dist.all_gather_into_tensor(flat, x.reshape(shape), group=group)
        out[f"all_gather_into_tensor {shape}"] = flat
    buffer = x.clone().reshape(-1)
    dist.all_gather_into_tensor(buffer[0:6], buffer, group=group)  # megatron's in-place bucket gather
    out["all_gather_into_tensor in place"] = buffer
    shard = torch.zeros(2, 3)
    dist.reduce_scatter_tensor(shard, x, group=group)
    out["reduce_scatter_tensor"] = shard
    shard = torch.zeros(2, 3)
    dist.reduce_scatter(shard, [x], group=group)
    out["reduce_scatter"] = shard
    gathered = [torch.zeros(2, 3)]
    dist.gather(x, gathered, dst=0, group=group)
    out["gather"] = gathered[0]
    scattered = torch.zeros(2, 3)
    dist.scatter(scattered, [x], src=0, group=group)
    out["scatter"] = scattered
    exchanged = torch.zeros(2, 3)
    dist.all_to_all_single(exchanged, x, group=group)
    out["all_to_all_single"] = exchanged
    exchanged = [torch.zeros(2, 3)]
    dist.all_to_all(exchanged, [x], group=group)
    out["all_to_all"] = exchanged[0]
    out.update(_coalesced_and_objects(group, x))
    dist.barrier(group=group)
    return {name: value.tolist() for name, value in out.items()}


def _coalesced_and_objects(group, x) -> dict:
    """megatron's gradient-bucket path (all-reduces and gathers under torch's coalescing manager, waited for
    after) and the object collectives its checkpointing uses."""
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _coalescing_manager

    out = {}
    first, second = x.clone(), x.clone() * 2
    with _coalescing_manager(group, async_ops=True) as coalesced:
        dist.all_reduce(first, group=group, async_op=True)
        dist.all_reduce(second, group=group, async_op=True)
    coalesced.wait()
    out["coalesced all_reduce"] = torch.stack([first, second])
    gathered = torch.zeros(2, 2, 3)
    with _coalescing_manager(group, async_ops=False):
        dist.all_gather_into_tensor(gathered[0], x, group=group, async_op=True)
        dist.all_gather_into_tensor(gathered[1], x * 3, group=group, async_op=True)
    out["coalesced all_gather_into_tensor"] = gathered
    objects = [None]
    dist.all_gather_object(objects, {"step": 3}, group=group)
    listed = [{"lr": 0.1}]
    dist.broadcast_object_list(listed, src=0, group=group)
    collected = [None]
    dist.gather_object({"rank": 0}, collected, dst=0, group=group)
    received = [None]
    dist.scatter_object_list(received, [{"part": 1}], src=0, group=group)
    out["objects"] = torch.tensor([objects[0]["step"], listed[0]["lr"], collected[0]["rank"], received[0]["part"]])
    return out


def gloo_and_one_rank_collectives() -> dict:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    import adapter

    adapter.init_distributed()
    created = parallel_state.create_group([0], group_desc="ONE_RANK_TEST")
    gloo = dist.new_group([0], backend="gloo")
    refused, missized = {}, {}
    for name, group in (("one rank", created), ("gloo", gloo)):
        try:
            dist.all_reduce(torch.ones(2), op=dist._make_nccl_premul_sum(2.0), group=group)
        except RuntimeError as error:
            refused[name] = str(error)
        try:
            dist.all_gather_into_tensor(torch.zeros(5), torch.ones(6), group=group)
        except (RuntimeError, ValueError) as error:
            missized[name] = str(error)
    result = {"backends": [dist.get_backend(created), dist.get_backend(gloo)], "one rank": _collectives(created),
              "gloo": _collectives(gloo), "premul_sum": refused, "missized": missized,
              "name": created.group_name}
    dist.destroy_process_group(created)  # by itself, as megatron's destroy_model_parallel does
    dist.destroy_process_group()
    return result


@pytest.mark.multiproc
def test_every_collective_of_a_one_rank_group_gives_what_gloo_gives():
    [result] = run_ranks(1, gloo_and_one_rank_collectives)
    assert result["backends"] == ["adapter_one_rank", "gloo"]
    assert result["one rank"] == result["gloo"] and result["name"]
    assert len(result["gloo"]) == 22
    assert set(result["premul_sum"]) == {"one rank", "gloo"}  # both refuse NCCL's pre-multiplied sum
    assert "Cannot use ReduceOp.PREMUL_SUM with Gloo" in result["premul_sum"]["one rank"]
    assert set(result["missized"]) == {"one rank", "gloo"}  # an output of the wrong size
    assert "holds 5 elements and its input 6" in result["missized"]["one rank"]


def megatron_layout_backends() -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state

    import adapter

    adapter.init_distributed()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    groups = {"tensor": parallel_state.get_tensor_model_parallel_group(),
              "pipeline": parallel_state.get_pipeline_model_parallel_group(),
              "data": parallel_state.get_data_parallel_group(),
              "data (gloo)": parallel_state.get_data_parallel_group_gloo(),
              "model": parallel_state.get_model_parallel_group()}
    backends = {name: dist.get_backend(group) for name, group in groups.items()}
    import torch

    total = torch.ones(1)
    dist.all_reduce(total, group=groups["data"])
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return {"backends": backends, "data-parallel sum": total.item()}


@pytest.mark.multiproc
def test_megatron_layout_makes_its_one_rank_groups_here_and_keeps_gloo_for_the_others():
    ranks = run_ranks(2, megatron_layout_backends)
    for rank in ranks:
        assert rank["backends"] == {"tensor": "adapter_one_rank", "pipeline": "adapter_one_rank",
                                    "data": "gloo", "data (gloo)": "gloo", "model": "adapter_one_rank"}
        assert rank["data-parallel sum"] == 2.0


def _gloo_threads() -> int:
    """This process's threads named as gloo's workers; a thread a worker starts (its OpenMP team) takes
    its name."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            names.append(open(f"/proc/self/task/{task}/comm").read().strip())
        except OSError:  # the thread ended
            pass
    return names.count("pt_gloo_runloop")


def train_counting_gloo_threads(gloo_groups: bool, save: str, extra: list[str]) -> dict:
    """scripts/pretrain_gpt.py's pretrain (megatron.training's) at one rank with the distributed optimizer
    and a save at step 3, given ``extra`` arguments; ``gloo_groups``: megatron's one-rank groups stay gloo's
    (the reference). Two intra-op threads, whatever the machine has: a team needs two."""
    import torch

    from megatron.training import training

    from adapter import one_rank_groups
    from tests.flow_ranks import logged_losses, run_pretrain

    torch.set_num_threads(2)
    if gloo_groups:
        os.environ[one_rank_groups.SETTING] = "none"
    counted, train_step = [], training.train_step

    def step(*args, **kwargs):
        if not counted:
            counted.append(_gloo_threads())
        return train_step(*args, **kwargs)

    training.train_step = step
    losses = logged_losses([run_pretrain([*_ARGV, "--save", save, *extra])])
    return {"losses": losses, "started": _gloo_threads() - counted[0]}


# overlapped: the bucket collectives asynchronous, the parameter gather waited for in the next forward
_OVERLAPPED = ["--overlap-grad-reduce", "--overlap-param-gather", "--ddp-bucket-size", "20000"]


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.megatron_training
@pytest.mark.parametrize("extra", [[], _OVERLAPPED], ids=["synchronous", "overlapped"])
def test_one_rank_distributed_optimizer_keeps_gloo_threads_idle_and_the_curve_exact(tmp_path, extra):
    [mine] = run_ranks(1, train_counting_gloo_threads, False, str(tmp_path / "mine"), extra)
    [gloo] = run_ranks(1, train_counting_gloo_threads, True, str(tmp_path / "gloo"), extra)
    assert mine["losses"] == gloo["losses"] and len(mine["losses"]) == 6
    assert gloo["started"] > 0, "gloo's collectives no longer start threads: one-rank groups may be unneeded"
    assert mine["started"] == 0

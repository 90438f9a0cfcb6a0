"""Collectives over one rank answered on the training thread (patches/one_rank_collectives.py): the
distributed optimizer's curve is gloo's to the bit, and gloo's worker threads start no OpenMP team of their
own, which would leave libgomp throttling the training thread's (the module's docstring)."""

from __future__ import annotations

import pytest

from tests.distributed import run_ranks

pytestmark = pytest.mark.multiproc

_ARGV = ["--model", "qwen2.5-tiny", "--micro-batch-size", "2", "--global-batch-size", "2", "--seq-length", "64",
         "--train-iters", "6", "--lr", "3e-3", "--lr-decay-style", "constant", "--mock-data", "--log-interval", "1",
         "--eval-iters", "0", "--hidden-dropout", "0", "--attention-dropout", "0", "--use-distributed-optimizer",
         "--seed", "7", "--save-interval", "3"]


def _gloo_threads() -> int:
    """This process's threads named as gloo's workers; a thread a worker starts (its OpenMP team) takes
    its name."""
    import os

    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            names.append(open(f"/proc/self/task/{task}/comm").read().strip())
        except OSError:  # the thread ended
            pass
    return names.count("pt_gloo_runloop")


def train_counting_gloo_threads(real_collectives: bool, save: str, extra: list[str]) -> dict:
    """The flow at one rank with the distributed optimizer and a save at step 3, given ``extra`` arguments;
    ``real_collectives``: every one-rank collective goes to gloo (the reference). Two intra-op threads,
    whatever the machine has: a team needs two."""
    import torch

    import patches.one_rank_collectives as one_rank
    from adapter.training import pretrain as flow
    from tests.pretrain_ranks import logged_losses, run_pretrain

    torch.set_num_threads(2)
    if real_collectives:
        one_rank._one_rank = lambda group: False
    counted, train_step = [], flow.train_step

    def step(*args, **kwargs):
        if not counted:
            counted.append(_gloo_threads())
        return train_step(*args, **kwargs)

    flow.train_step = step
    losses = logged_losses([run_pretrain([*_ARGV, "--save", save, *extra])])
    return {"losses": losses, "started": _gloo_threads() - counted[0]}


# overlapped: the bucket collectives asynchronous, the parameter gather waited for in the next forward
_OVERLAPPED = ["--overlap-grad-reduce", "--overlap-param-gather", "--ddp-bucket-size", "20000"]


@pytest.mark.parametrize("extra", [[], _OVERLAPPED], ids=["synchronous", "overlapped"])
def test_one_rank_distributed_optimizer_keeps_gloo_threads_idle_and_the_curve_exact(tmp_path, extra):
    [mine] = run_ranks(1, train_counting_gloo_threads, False, str(tmp_path / "mine"), extra)
    [gloo] = run_ranks(1, train_counting_gloo_threads, True, str(tmp_path / "gloo"), extra)
    assert mine["losses"] == gloo["losses"] and len(mine["losses"]) == 6
    assert gloo["started"] > 0, "gloo's collectives no longer start threads: the patch may be unneeded"
    assert mine["started"] == 0


def one_rank_calls() -> dict:
    import torch

    import adapter
    from megatron.core.distributed import param_and_grad_buffer as buffers
    from patches.one_rank_collectives import OneRankGathers

    adapter.init_distributed()
    status = {name: adapter.registry.status(f"{buffers.__name__}:{name}")
              for name in ("dist_reduce_scatter_func", "dist_all_gather_func")}
    grads = torch.arange(8.0)
    in_place = buffers.dist_reduce_scatter_func(grads[0:8], grads, op=torch.distributed.ReduceOp.SUM,
                                                group=None, async_op=True)
    elsewhere = torch.zeros(8)
    buffers.dist_all_gather_func(elsewhere, grads, group=None)  # not in place: gloo copies it
    parts, gathered = [torch.zeros(8)], [torch.zeros(8)]
    with OneRankGathers():
        handle = torch.distributed.all_gather(parts, grads + 1, None, True)
        torch.distributed.gather(grads + 2, gathered, 0, None)
    handle.wait()
    torch.distributed.destroy_process_group()
    return {"status": status, "handle_done": in_place.is_completed(), "grads": grads.tolist(),
            "elsewhere": elsewhere.tolist(), "parts": parts[0].tolist(), "gathered": gathered[0].tolist()}


def test_one_rank_collectives_give_what_gloo_gives():
    [result] = run_ranks(1, one_rank_calls)
    assert set(result["status"].values()) == {"applied"}
    assert result["handle_done"] and result["grads"] == list(range(8))
    assert result["elsewhere"] == result["grads"]
    assert result["parts"] == [v + 1 for v in range(8)] and result["gathered"] == [v + 2 for v in range(8)]

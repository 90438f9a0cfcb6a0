"""Megatron-LM's own pretrain_gpt.py, unchanged, trains through ``torchrun -m adapter.run`` on the CPU (issue 7).

Needs a Megatron-LM checkout at tag core_v0.16.1 on PYTHONPATH (and ``six``, which its tokenizers import);
skipped with the reason otherwise. Each run is a real torchrun of the launcher, the documented path. The
runs are shared, one module-scoped fixture per layout, so the whole file is four trainings:

- TP2 x PP2 on 4 ranks, --mock-data, 20 iterations saving every 10 with --async-save through the
  persistent checkpoint worker (a spawned process), then a resume from iteration 10 to 20. Dropout is 0.1,
  stricter than dropout 0: the dropout RNG streams have to resume exactly too.
- DP2 with --use-distributed-optimizer on 2 ranks, on a --data-path made by our scripts/preprocess_data.py
  (scripts/prepare_sample_data.py), evaluating every 10 iterations, then a resume from iteration 10.

Losses are compared as Megatron-LM logs them (%E, 7 digits). Its training log prints the mean of
iterations 11 and 12 as the second value after a (re)start, so the resume is compared at 15 and 20.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from adapter.core_source import megatron_lm_checkout
from adapter.checkpoint_dir import COMMON_STATE_IN_SHARDS
from tests.distributed import ROOT

pytestmark = pytest.mark.megatron_lm

TINY_QWEN = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--group-query-attention",
             "--num-query-groups", "2", "--seq-length", "64", "--max-position-embeddings", "64",
             "--transformer-impl", "local", "--normalization", "RMSNorm", "--swiglu",
             "--position-embedding-type", "rope", "--add-qkv-bias", "--disable-bias-linear",
             "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3", "--train-iters", "20",
             "--log-interval", "1", "--seed", "1234"]
TRAIN_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: (\S+) \|")
VALID_LINE = re.compile(r"validation loss at iteration (\d+) \| lm loss value: (\S+) \|")


def _pretrain_gpt() -> Path:
    return megatron_lm_checkout() / "pretrain_gpt.py"


def _run(workdir: Path, name: str, nproc: int, args: list[str], launch: tuple = ("-m", "adapter.run"),
         script: Path | None = None) -> str:
    """``torchrun --nproc-per-node nproc -m adapter.run pretrain_gpt.py args`` on the cpu backend, in
    ``workdir`` (``launch``: torchrun's arguments before the script's; ``script``: another than Megatron-LM's
    pretrain_gpt.py); the log, or the test fails with its tail."""
    env = {**os.environ, "ADAPTER_BACKEND": "cpu", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    log = workdir / f"{name}.log"
    with open(log, "w") as out:
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               "--nproc-per-node", str(nproc), *launch, str(script or _pretrain_gpt()), *args],
                              cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=600)
    text = log.read_text()
    assert done.returncode == 0, f"{name} failed (exit status {done.returncode}):\n{text[-6000:]}"
    return text


def _losses(log: str, pattern=TRAIN_LINE) -> dict[int, str]:
    return {int(iteration): loss for iteration, loss in pattern.findall(log)}


def _checkpoint_at(source: Path, iteration: int, target: Path) -> Path:
    """A load directory holding only ``source``'s checkpoint of ``iteration``."""
    name = f"iter_{iteration:07d}"
    shutil.copytree(source / name, target / name)
    (target / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return target


def _async_strategy_arguments() -> list[str]:
    """Megatron-LM 0.19's --async-save defaults to the nvidia-resiliency-ext strategy (a CUDA library not
    installed here; megatron then says to install it or pick mcore): the mcore one, where the flag exists."""
    checkout = megatron_lm_checkout()
    config = checkout / "megatron" / "training" / "config" / "training_config.py" if checkout else None
    return ["--async-strategy", "mcore"] if config and config.is_file() and "async_strategy:" in config.read_text() \
        else []


_MCORE_ASYNC_STRATEGY = _async_strategy_arguments()


@pytest.fixture(scope="module")
def tp2_pp2(tmp_path_factory):
    """(uninterrupted log, resumed log, save directory) of the TP2 x PP2 runs."""
    workdir = tmp_path_factory.mktemp("tp2-pp2")
    common = TINY_QWEN + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                          "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
                          "--eval-iters", "0", "--eval-interval", "20", "--attention-dropout", "0.1",
                          "--hidden-dropout", "0.1"]
    full = _run(workdir, "full", 4, common + ["--save", "saved", "--save-interval", "10", "--async-save",
                                             "--use-persistent-ckpt-worker", *_MCORE_ASYNC_STRATEGY])
    load = _checkpoint_at(workdir / "saved", 10, workdir / "resume-from-10")
    resumed = _run(workdir, "resumed", 4, common + ["--load", str(load)])
    return full, resumed, workdir / "saved"


@pytest.fixture(scope="module")
def dp2_real_data(tmp_path_factory):
    """(uninterrupted log, resumed log) of the DP2 distributed-optimizer runs on the sample corpus."""
    from scripts import prepare_sample_data

    workdir = tmp_path_factory.mktemp("dp2")
    prefix = prepare_sample_data.prepare(workdir / "data")
    common = TINY_QWEN + ["--use-distributed-optimizer", "--data-path", prefix, "--split", "949,50,1",
                          "--tokenizer-type", "GPTSentencePieceTokenizer",
                          "--tokenizer-model", str(workdir / "data" / "tokenizer.model"),
                          "--eval-interval", "10", "--eval-iters", "2", "--attention-dropout", "0",
                          "--hidden-dropout", "0"]
    full = _run(workdir, "full", 2, common + ["--save", "saved", "--save-interval", "10"])
    load = _checkpoint_at(workdir / "saved", 10, workdir / "resume-from-10")
    resumed = _run(workdir, "resumed", 2, common + ["--load", str(load)])
    return full, resumed


@pytest.mark.multiproc
@pytest.mark.slow
def test_a_rank_lost_at_start_up_is_restarted_by_torchrun_and_the_run_finishes(tmp_path):
    """torchrun --max-restarts 1 with rank 1 lost as megatron creates its groups (tests/megatron_lm_restart.py):
    the second generation meets under a store prefix of its own, not at the addresses the first left in
    torchrun's store, and trains every iteration. Without the prefix it is a race which addresses a rank
    reads: 3 runs of 5 ended in gloo's ``Connection refused`` here."""
    args = TINY_QWEN + ["--train-iters", "4", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size",
                        "1000", "--eval-iters", "0", "--eval-interval", "4", "--tensor-model-parallel-size", "2"]
    log = _run(tmp_path, "restarted", 2, args,
               launch=("--max-restarts", "1", str(ROOT / "tests" / "megatron_lm_restart.py")))
    assert "(exitcode: -9) local_rank: 1" in log  # the first generation lost rank 1, as placed
    assert "Connection refused" not in log
    assert sorted(_losses(log)) == [1, 2, 3, 4], log[-3000:]


@pytest.mark.multiproc
@pytest.mark.slow
def test_tp2_pp2_trains_on_gloo_and_the_loss_falls(tp2_pp2):
    full, _, _ = tp2_pp2
    assert "[adapter] --distributed-backend nccl -> gloo on the cpu backend" in full
    losses = _losses(full)
    assert sorted(losses) == list(range(1, 21))
    assert float(losses[20]) < float(losses[1]) - 0.2, losses


@pytest.mark.multiproc
@pytest.mark.slow
def test_tp2_pp2_async_save_through_the_persistent_worker_writes_loadable_checkpoints(tp2_pp2):
    full, resumed, saved = tp2_pp2
    assert full.count("scheduled an async checkpoint save at iteration") == 2
    assert (saved / "latest_checkpointed_iteration.txt").read_text().strip() == "20"
    for iteration in ("iter_0000010", "iter_0000020"):
        assert (saved / iteration / "metadata.json").is_file()
        # the common state: common.pt up to 0.18, inside the torch_dist files from 0.19 (adapter.checkpoint_dir)
        assert (saved / iteration / "common.pt").is_file() is not COMMON_STATE_IN_SHARDS
    assert re.search(r"successfully loaded checkpoint from \S+resume-from-10 .*at iteration 10", resumed)
    assert min(_losses(resumed)) == 11


@pytest.mark.multiproc
@pytest.mark.slow
def test_tp2_pp2_resume_at_10_gives_the_uninterrupted_losses_at_15_and_20(tp2_pp2):
    full, resumed, _ = tp2_pp2
    uninterrupted, after_resume = _losses(full), _losses(resumed)
    assert (after_resume[15], after_resume[20]) == (uninterrupted[15], uninterrupted[20])
    compared = (11, *range(13, 21))  # every iteration but 12, which logs the mean of 11 and 12 after a restart
    assert {i: after_resume[i] for i in compared} == {i: uninterrupted[i] for i in compared}


@pytest.mark.multiproc
@pytest.mark.slow
def test_dp2_distributed_optimizer_trains_on_preprocessed_data_with_validation(dp2_real_data):
    full, _ = dp2_real_data
    losses, validation = _losses(full), _losses(full, VALID_LINE)
    assert sorted(losses) == list(range(1, 21))
    assert float(losses[20]) < float(losses[1]) - 0.2, losses
    assert sorted(validation) == [10, 20] and all(math.isfinite(float(v)) for v in validation.values())
    assert float(validation[20]) < float(validation[10])


@pytest.mark.multiproc
@pytest.mark.slow
def test_dp2_distributed_optimizer_resumes_exactly(dp2_real_data):
    full, resumed = dp2_real_data
    uninterrupted, after_resume = _losses(full), _losses(resumed)
    assert (after_resume[15], after_resume[20]) == (uninterrupted[15], uninterrupted[20])
    compared = (11, *range(13, 21))
    assert {i: after_resume[i] for i in compared} == {i: uninterrupted[i] for i in compared}
    assert _losses(resumed, VALID_LINE)[20] == _losses(full, VALID_LINE)[20]


# On the npu backend (torch_npu double, as tests/test_npu_routing.py), Megatron-LM's own torch.cuda calls
# reach torch.npu, validate_args picks hccl, and the cpu-only patches stay out.
NPU_PROGRAM = r"""
import json, os, sys, types
import torch

npu = types.ModuleType("torch.npu")
npu.is_available = lambda: True
npu.device_count = lambda: 2
npu.current_device = lambda: 1
torch.utils.rename_privateuse1_backend("npu")
torch._register_device_module("npu", npu)

import adapter
from megatron.training import arguments, checkpointing, initialize, training, utils

os.environ["WORLD_SIZE"] = "2"
os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
sys.argv = ["pretrain_gpt.py", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2",
            "--tensor-model-parallel-size", "2", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
            "--mock-data", "--train-iters", "1", "--lr", "1e-3", "--eval-interval", "1000"]
args = arguments.validate_args(arguments.parse_args())
print("RESULT " + json.dumps({
    "status": {p.target: adapter.registry.status(p.target) for p in adapter.registry.patches()
               if p.target.startswith(("megatron.training", "megatron.legacy"))},
    "device_count": initialize.torch.cuda.device_count(),
    "current_device": training.torch.cuda.current_device(),
    # 0.19 made megatron.training.utils a package: its functions (and torch) live in utils.common_utils
    "views": [m.torch.cuda is adapter.device for m in (initialize, training, getattr(utils, "common_utils", utils),
                                                        checkpointing)],
    "arch": utils.get_device_arch_version(),
    "dist_backend": args.distributed_backend,
    "gradient_accumulation_fusion": args.gradient_accumulation_fusion,
    "connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
}))
"""


def _in_checkout(module: str) -> bool:
    path = megatron_lm_checkout().joinpath(*module.split("."))
    return path.is_dir() or path.with_suffix(".py").is_file()


@pytest.mark.slow
def test_on_npu_megatron_lm_cuda_calls_reach_torch_npu_and_hccl_is_chosen():
    pythonpath = [str(ROOT / "tests" / "doubles"), str(ROOT), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "ADAPTER_BACKEND": "npu", "PYTHONPATH": os.pathsep.join(pythonpath)}
    done = subprocess.run([sys.executable, "-c", NPU_PROGRAM], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
    # the only target whose every patch is the cpu backend's (build_train_valid_test_data_iterators has a cpu-only
    # wrap too, and the corpus check on every backend, so it is applied)
    cpu_only = {"megatron.training.initialize:_warmup_jit_function"}
    # patches of a module this checkout lacks wait for it (megatron.legacy left Megatron-LM in 0.18,
    # megatron.training.activation_logging came in 0.19)
    gone = {t for t in seen["status"] if not _in_checkout(t.partition(":")[0])}
    assert {t for t, s in seen["status"].items() if s != "applied"} == cpu_only | gone
    assert all(seen["status"][t] == "pending" or seen["status"][t].startswith("skipped") for t in gone)
    assert all(seen["status"][t] == "not for npu" for t in cpu_only)
    assert seen["views"] == [True] * 4
    assert (seen["device_count"], seen["current_device"], seen["arch"]) == (2, 1, 0)
    assert (seen["dist_backend"], seen["gradient_accumulation_fusion"], seen["connections"]) == ("hccl", False, "1")


@pytest.mark.multiproc
@pytest.mark.slow
def test_a_rank_killed_while_saving_is_restarted_from_the_last_complete_checkpoint(tmp_path):
    """Saves every 2 iterations of 6; in torchrun's first generation rank 1 is SIGKILLed as it writes iteration
    4 (tests/megatron_lm_killed_save.py), with ``--max-restarts 1``. Iteration 4 was being written into its
    ``.partial`` directory, so the tracker still names the complete iteration 2: the second generation recovers
    the directory, resumes from 2 and trains on to 6 (adapter/checkpoint_publish.py), on the curve of a run
    that was never killed."""
    args = TINY_QWEN + ["--train-iters", "6", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size",
                        "1000", "--eval-iters", "0", "--eval-interval", "6", "--tensor-model-parallel-size", "2",
                        "--attention-dropout", "0", "--hidden-dropout", "0", "--save", "saved", "--load", "saved",
                        "--save-interval", "2"]
    log = _run(tmp_path, "killed", 2, args,
               launch=("--max-restarts", "1", str(ROOT / "tests" / "megatron_lm_killed_save.py")))
    (tmp_path / "never-killed").mkdir()
    uninterrupted = _losses(_run(tmp_path / "never-killed", "full", 2, args))
    _, restarted = log.split("(exitcode: -9) local_rank: 1", 1)  # the first generation lost rank 1, as placed
    assert "saved: removed .iter_0000004.partial, an unpublished write" in restarted
    assert re.search(r"successfully loaded checkpoint from saved .* at iteration 2\n", restarted)
    resumed = _losses(restarted)  # at 4 Megatron-LM's log prints the mean of 3 and 4, as after any restart
    assert {i: resumed[i] for i in (3, 5, 6)} == {i: uninterrupted[i] for i in (3, 5, 6)}
    saved = tmp_path / "saved"
    assert (saved / "latest_checkpointed_iteration.txt").read_text() == "6"
    assert sorted(p.name for p in saved.iterdir()) == ["iter_0000002", "iter_0000004", "iter_0000006",
                                                       "latest_checkpointed_iteration.txt"]

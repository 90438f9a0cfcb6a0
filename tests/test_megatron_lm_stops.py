"""How Megatron-LM's own pretrain_gpt.py, through ``torchrun -m adapter.run``, ends a run that cannot go on:
a stalled rank (patches/liveness.py) and a diverging loss (patches/nonfinite.py), each in one line for the job.
Needs a Megatron-LM checkout on PYTHONPATH (tests/test_megatron_lm.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.distributed import ROOT
from tests.test_megatron_lm import TINY_QWEN, _pretrain_gpt

pytestmark = [pytest.mark.megatron_lm, pytest.mark.multiproc, pytest.mark.slow]

TP2 = TINY_QWEN + ["--train-iters", "6", "--tensor-model-parallel-size", "2", "--mock-data", "--tokenizer-type",
                   "NullTokenizer", "--vocab-size", "256", "--eval-iters", "1", "--eval-interval", "3"]


def _torchrun(workdir: Path, args: list[str], launch: list[str], env: dict | None = None) -> tuple[int, str, float]:
    """(exit status, everything printed, seconds) of torchrun on 2 cpu ranks, in ``workdir``."""
    env = {**os.environ, "ADAPTER_BACKEND": "cpu", "OMP_NUM_THREADS": "1", **(env or {}),
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           *launch, str(_pretrain_gpt()), *args], cwd=workdir, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=600)
    return done.returncode, done.stdout, time.monotonic() - start


def _errors(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("error:")]


def test_a_stalled_rank_ends_its_peer_within_the_timeout_with_the_line_naming_the_group(tmp_path):
    """Rank 1 stops answering (SIGSTOP) as iteration 3 begins (tests/megatron_lm_stall.py); rank 0, in that
    step's first collective (the batch's broadcast over the tensor-parallel group), ends within the minute
    with one line naming it, its group, its ranks and rank 1. Megatron-LM alone: gloo's ``Timed out waiting
    60000ms for send operation`` traceback, naming no group."""
    status, output, seconds = _torchrun(tmp_path, TP2 + ["--distributed-timeout-minutes", "1"],
                                        [str(ROOT / "tests" / "megatron_lm_stall.py")],
                                        env={"ADAPTER_TEST_STALL_AT": "3"})
    assert status != 0
    assert _errors(output) == ["error: rank 0: broadcast on the tensor model parallel group (ranks [0, 1]) timed out "
                               "after 60 s (--distributed-timeout-minutes 1): rank 1 did not arrive; ending this "
                               "process"], output[-6000:]
    assert "[rank0]: Traceback" not in output
    assert seconds < 240  # start-up, two iterations, the minute and torchrun's 30 s before it SIGKILLs rank 1


def test_a_diverging_run_ends_in_one_line_and_its_checkpoint_holds_finite_weights(tmp_path):
    """--lr 1e12: iteration 1 is finite, its step makes iteration 2's loss NaN. Megatron-LM's rerun state
    machine re-runs it, finds it again, saves iteration 1 and exits 16; the job's last word is one line naming
    iteration 2, the value and what to do, and no rank prints a traceback. The checkpoint saved holds
    iteration 1's weights: every tensor in it is finite."""
    from torch.distributed.checkpoint import FileSystemReader, load

    status, output, _ = _torchrun(tmp_path, TP2 + ["--lr", "1e12", "--save", "saved", "--save-interval", "4"],
                                  ["-m", "adapter.run"])
    assert status != 0 and "(exitcode: 16)" in output, output[-6000:]
    assert _errors(output) == [
        "error: iteration 2: the loss is nan on rank 0 (found NaN in local forward loss calculation); a re-run gave "
        "it again: the training diverged (lower --lr, now 1e+12) or this device is faulty. Megatron-LM saved "
        "iteration 1 to saved with its re-run state: loaded on another device it re-runs iteration 2 to tell which "
        "(on this one it exits 16 again); to train on, resume from a checkpoint saved before the loss diverged"], \
        output[-6000:]
    assert not re.search(r"\[rank\d\]: Traceback", output), output[-6000:]
    saved = tmp_path / "saved"
    assert (saved / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    reader = FileSystemReader(str(saved / "iter_0000001"))
    tensors = {key: torch.empty(meta.size, dtype=meta.properties.dtype)  # the weights and the optimizer's state
               for key, meta in reader.read_metadata().state_dict_metadata.items() if hasattr(meta, "size")}
    load(tensors, storage_reader=reader, no_dist=True)
    assert "embedding.word_embeddings.weight" in tensors and any(key.startswith("optimizer.") for key in tensors)
    assert all(torch.isfinite(t).all() for t in tensors.values() if t.is_floating_point())

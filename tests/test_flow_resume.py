"""A checkpoint saved by the project's earlier training loop (adapter/training, removed with issue 50; the
checkpoints here were recorded with it) resumes in scripts/pretrain_gpt.py (megatron.training's own
``pretrain``) on the curve it was saved on (issue 50 point 3): the torch_dist checkpoint the loop saved
under megatron-core 0.16.1 before it wrote megatron's ``args`` (tests/upgrade_checkpoint.py), at its TP2
layout and at TP1 x DP2, and an fsdp_dtensor one saved with Megatron-FSDP (tests/own_flow_checkpoint.py).
Iterations 5-8 give the losses the loop recorded, within 2e-4 as tests/test_checkpoint_upgrade.py compares them
(another machine's summation order).

The loop's arguments become Megatron-LM's, with the loop's defaults where megatron's differ given explicitly:
its NullTokenizer (megatron 0.19's holds --vocab-size entries, the loop's one more: the end-of-document id the
mock data ends each document with), the local layer spec, no attention mask from the data loader, its split
and initialization. megatron.training logs the first iteration of a process without resetting its sums, so
the next line is the mean of the two (as tests/test_megatron_lm.py reads Megatron-LM's own resume).
"""

from __future__ import annotations

import re

import pytest
import torch

from adapter import earlier_checkpoints
from tests import own_flow_checkpoint, upgrade_checkpoint
from tests.distributed import launch_script
from tests.flow_ranks import stopped_at

TOLERANCE = 2e-4
TRAIN_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: (\S+) \|")
# the own loop's defaults where megatron.training's differ
OWN_DEFAULTS = ["--tokenizer-type", "NullTokenizer", "--transformer-impl", "local",
                "--no-create-attention-mask-in-dataloader", "--split", "969,30,1", "--init-method-std", "0.02"]


def _torch_dist(tp: int) -> list[str]:
    """The 0.16.1 run's flags for megatron.training: qwen2.5-tiny's 512 rows are the loop's NullTokenizer."""
    return [*upgrade_checkpoint.argv(tp), *OWN_DEFAULTS, "--vocab-size", "512"]


def _fsdp_dtensor() -> list[str]:
    argv = list(own_flow_checkpoint.ARGV)
    argv[argv.index("--vocab-size") + 1] = "128"  # the loop's 127 and its end-of-document id
    return [*argv, *OWN_DEFAULTS]


CASES = {"torch_dist TP2": (upgrade_checkpoint, _torch_dist(2), 2),
         "torch_dist TP1 x DP2": (upgrade_checkpoint, _torch_dist(1), 2),
         "fsdp_dtensor DP2": (own_flow_checkpoint, _fsdp_dtensor(), 2)}


def _as_megatron_logs(curve: dict[int, float], first: int) -> dict[int, float]:
    """The recorded curve as megatron.training logs it from iteration ``first`` on: the second line the mean
    of the first two."""
    logged = {i: loss for i, loss in curve.items() if i >= first}
    logged[first + 1] = (curve[first] + curve[first + 1]) / 2
    return logged


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_a_checkpoint_of_the_own_loop_resumes_in_megatron_training_on_its_curve(tmp_path, case):
    module, argv, ranks = CASES[case]
    load = stopped_at(module.DATA, module.SAVED_AT, tmp_path / "load")
    outputs = launch_script("scripts/pretrain_gpt.py", [*argv, "--load", str(load)], world_size=ranks)
    assert all(status == 0 for status, _ in outputs), outputs[0][1][-6000:]
    assert re.search(rf"successfully loaded checkpoint from {load} .*at iteration {module.SAVED_AT}\b", outputs[0][1])
    printed = outputs[-1][1]  # the last rank prints the iteration lines
    resumed = {int(i): float(loss) for i, loss in TRAIN_LINE.findall(printed)}
    expected = _as_megatron_logs(module.recorded()["lm loss"], module.SAVED_AT + 1)
    assert sorted(resumed) == sorted(expected)
    worst = max(abs(resumed[i] - expected[i]) for i in expected)
    assert worst <= TOLERANCE, f"largest loss difference {worst:.3g}: {resumed} vs recorded {expected}"


def test_the_loop_s_earlier_common_state_reads_as_megatron_reads_its_own():
    """What megatron.training reads beside the tensors of the 0.16.1 checkpoint: its TP2 layout (not TP1), the
    32 samples consumed (not 0), the loop's fully reshardable optimizer state (not dp_zero_gather_scatter)."""
    common = torch.load(upgrade_checkpoint.DATA / "iter_0000004" / "common.pt", weights_only=False)
    run = type("Args", (), {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4})()
    assert earlier_checkpoints.is_earlier_flow_checkpoint(common)
    read = earlier_checkpoints.as_megatron_reads(common, run)
    saved = read["args"]
    assert (saved.tensor_model_parallel_size, saved.pipeline_model_parallel_size, saved.data_parallel_size) == (2, 1, 1)
    assert (saved.consumed_train_samples, saved.consumed_valid_samples, saved.num_layers) == (32, 0, 2)
    assert read["content_metadata"]["distrib_optim_sharding_type"] == "fully_reshardable"
    assert not earlier_checkpoints.is_earlier_flow_checkpoint(read)  # megatron's own, and the loop's since


def test_the_loop_s_earlier_rng_names_become_megatron_s():
    loaded = {"layout": {"tp": 1, "pp": 1, "dp": 2}, "rng_state": [{"random": 1, "numpy": 2, "torch": 3,
                                                                     "device": 4, "tracker": {}}]}
    run = type("Args", (), {"num_layers": 1, "hidden_size": 8, "num_attention_heads": 1})()
    assert earlier_checkpoints.as_megatron_reads(loaded, run)["rng_state"] == [
        {"random_rng_state": 1, "np_rng_state": 2, "torch_rng_state": 3, "cuda_rng_state": 4,
         "rng_tracker_states": {}}]

"""Megatron-FSDP off CUDA, through megatron-core directly: the tiny GPT wrapped in megatron's
FullyShardedDataParallel (``optim_grads_params``) at DP2 and TP2 x DP2 on the cpu backend trains the loss curve
of DDP with the distributed optimizer (the reference), while each rank holds half the parameter and gradient
bytes and the optimizer state the distributed optimizer holds (both shard it over DP)."""

from __future__ import annotations

import argparse
import importlib.util

import pytest

from adapter import sharding
from adapter.cuda_only_features import RefusedSetting

from scripts.train_tiny_gpt import Run
from tests.conftest import DOUBLES
from tests.distributed import run_ranks
from tests.sharding_ranks import fsdp2_resume, train, train_fsdp2


def test_a_megatron_fsdp_run_that_saves_is_refused_in_one_line_and_one_that_does_not_passes():
    validate = sharding.refuse_unready_fsdp(lambda args: "validated")
    with pytest.raises(RefusedSetting, match=r"^--use-megatron-fsdp with --save ckpt: saving a Megatron-FSDP "
                                             r"checkpoint is not supported off CUDA yet .*--use-distributed-optimizer"):
        validate(argparse.Namespace(use_megatron_fsdp=True, save="ckpt"))
    assert validate(argparse.Namespace(use_megatron_fsdp=True, save=None)) == "validated"
    assert validate(argparse.Namespace(use_megatron_fsdp=False, save="ckpt")) == "validated"


def test_a_megatron_fsdp_run_without_einops_is_refused_in_one_line_naming_the_install(monkeypatch):
    validate = sharding.refuse_unready_fsdp(lambda args: "validated")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "einops" else real_find_spec(name, *a))
    with pytest.raises(RefusedSetting, match=r"^--use-megatron-fsdp needs einops, .*: pip install einops"):
        validate(argparse.Namespace(use_megatron_fsdp=True, save=None))
    assert validate(argparse.Namespace(use_megatron_fsdp=False, save=None)) == "validated"


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_fsdp_trains_the_distributed_optimizer_curve_on_half_the_bytes(tp):
    run = Run(tp=tp, steps=10)
    reference, sharded = run_ranks(2 * tp, train, run, False), run_ranks(2 * tp, train, run, True)
    for ref, fsdp in zip(reference, sharded):
        assert len(fsdp["losses"]) == 10
        assert max(abs(a - b) for a, b in zip(ref["losses"], fsdp["losses"])) <= 1e-5
        assert fsdp["param_bytes"] <= ref["param_bytes"] / 2 + 4096  # DP2 shards, padded to its alignment
        assert fsdp["grad_bytes"] <= ref["grad_bytes"] / 2 + 4096
        assert fsdp["optimizer_bytes"] <= ref["optimizer_bytes"] + 4096


# torch FSDP2 through megatron (--use-torch-fsdp2): megatron's TorchFullyShardedDataParallel, its device mesh on
# this backend's device type; on the cpu backend, and with the npu kernel provider over tests/doubles' torch_npu
NPU_DOUBLE = {"ADAPTER_BACKEND": "cpu", "ADAPTER_KERNELS": "npu", "PYTHONPATH": str(DOUBLES)}


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("tp, env", [(1, None), (2, None), (1, NPU_DOUBLE)], ids=["dp2", "tp2-dp2", "dp2-npu"])
def test_torch_fsdp2_trains_the_distributed_optimizer_curve_on_half_the_bytes(tp, env):
    run = Run(tp=tp, steps=10)
    reference = run_ranks(2 * tp, train, run, False, env=env)
    sharded = run_ranks(2 * tp, train_fsdp2, run, env=env)
    for ref, fsdp2 in zip(reference, sharded):
        assert len(fsdp2["losses"]) == 10
        assert max(abs(a - b) for a, b in zip(ref["losses"], fsdp2["losses"])) <= 1e-5
        # DDP holds whole parameters and gradients; FSDP2 one DP shard of each, between steps
        assert fsdp2["param_bytes"] <= ref["param_bytes"] / 2 + 4096
        assert fsdp2["grad_bytes"] <= ref["grad_bytes"] / 2 + 4096
        # Adam's moments of this rank's shard: what the distributed optimizer holds, within its padding
        assert abs(fsdp2["optimizer_bytes"] - ref["optimizer_bytes"]) <= 4096


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_torch_fsdp2_saves_torch_dist_and_resumes_exactly(tmp_path, bf16):
    for rank in run_ranks(2, fsdp2_resume, Run(steps=6), str(tmp_path), 3, bf16):
        assert len(rank["resumed"]) == 3
        assert rank["resumed"] == rank["uninterrupted"]


def test_megatron_lm_s_fsdp2_assertions_are_one_line_for_the_job_and_others_pass_through():
    def megatron_lm_validate(args):  # its assertions raised as plain Python raises them (pytest rewrites asserts)
        if not args.untie_embeddings_and_output_weights:
            raise AssertionError("--use-torch-fsdp2 requires --untie-embeddings-and-output-weights")
        if args.seq_length <= 0:
            raise AssertionError("seq_length must be positive")
        return "validated"

    validate = sharding.torch_fsdp2_requirements_in_one_line(megatron_lm_validate)
    with pytest.raises(RefusedSetting, match=r"^--use-torch-fsdp2 requires --untie-embeddings-and-output-weights "
                                             r"\(Megatron-LM's check\)$"):
        validate(argparse.Namespace(use_torch_fsdp2=True, untie_embeddings_and_output_weights=False, seq_length=64))
    with pytest.raises(AssertionError, match="seq_length"):
        validate(argparse.Namespace(use_torch_fsdp2=True, untie_embeddings_and_output_weights=True, seq_length=0))
    with pytest.raises(AssertionError, match="untie"):  # without FSDP2 the assertion is Megatron-LM's own
        validate(argparse.Namespace(use_torch_fsdp2=False, untie_embeddings_and_output_weights=False, seq_length=64))
    assert validate(argparse.Namespace(use_torch_fsdp2=True, untie_embeddings_and_output_weights=True,
                                       seq_length=64)) == "validated"

"""Megatron-FSDP off CUDA, through megatron-core directly: the tiny GPT wrapped in megatron's
FullyShardedDataParallel (``optim_grads_params``) at DP2 and TP2 x DP2 on the cpu backend trains the loss curve
of DDP with the distributed optimizer (the reference), while each rank holds half the parameter and gradient
bytes and the optimizer state the distributed optimizer holds (both shard it over DP); its fsdp_dtensor
checkpoint (megatron's state dicts, megatron_fsdp's uneven-DTensor preparation, torch's distributed checkpoint,
as Megatron-LM saves and loads it) resumes the uninterrupted curve bit for bit, also with the npu kernel
provider over the torch_npu double."""

from __future__ import annotations

import argparse
import importlib.util

import pytest
import torch

from adapter import sharding
from adapter.cuda_only_features import RefusedSetting

from scripts.train_tiny_gpt import Run
from tests.conftest import DOUBLES
from tests.distributed import run_ranks
from tests.sharding_ranks import fsdp2_resume, swiglu_split_resume, train, train_fsdp2, train_from_checkpoint

pytestmark = pytest.mark.multiproc  # the ddp_reference fixture starts ranks (a fixture cannot carry marks)


def test_a_megatron_fsdp_run_without_einops_is_refused_in_one_line_naming_the_install(monkeypatch):
    validate = sharding.fsdp_requirements_in_one_line(lambda args: "validated")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "einops" else real_find_spec(name, *a))
    with pytest.raises(RefusedSetting, match=r"^--use-megatron-fsdp needs einops, .*: pip install einops"):
        validate(argparse.Namespace(use_megatron_fsdp=True, save=None))
    assert validate(argparse.Namespace(use_megatron_fsdp=False, save=None)) == "validated"
    monkeypatch.undo()
    assert validate(argparse.Namespace(use_megatron_fsdp=True, save="ckpt")) == "validated"  # it saves


@pytest.fixture(scope="module")
def ddp_reference():
    """The reference run of both half-the-bytes tests, DDP with the distributed optimizer for 10 steps at TP
    ``tp`` on the cpu backend (the same run_ranks call in each): run once per TP."""
    runs = {}

    def reference(tp: int) -> list[dict]:
        if tp not in runs:
            runs[tp] = run_ranks(2 * tp, train, Run(tp=tp, steps=10), False)
        return runs[tp]
    return reference


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_fsdp_trains_the_distributed_optimizer_curve_on_half_the_bytes(tp, ddp_reference):
    run = Run(tp=tp, steps=10)
    reference, sharded = ddp_reference(tp), run_ranks(2 * tp, train, run, True)
    for ref, fsdp in zip(reference, sharded):
        assert len(fsdp["losses"]) == 10
        assert max(abs(a - b) for a, b in zip(ref["losses"], fsdp["losses"])) <= 1e-5
        assert fsdp["param_bytes"] <= ref["param_bytes"] / 2 + 4096  # DP2 shards, padded to its alignment
        assert fsdp["grad_bytes"] <= ref["grad_bytes"] / 2 + 4096
        assert fsdp["optimizer_bytes"] <= ref["optimizer_bytes"] + 4096


# the npu kernel provider on the CPU, over tests/doubles' torch_npu (as tests/test_pretrain.py runs it)
NPU_DOUBLE = {"ADAPTER_BACKEND": "cpu", "ADAPTER_KERNELS": "npu", "PYTHONPATH": str(DOUBLES)}


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("tp, env", [(1, None), (2, None), (1, NPU_DOUBLE)], ids=["dp2", "tp2-dp2", "dp2-npu-double"])
def test_megatron_fsdp_resumes_its_fsdp_dtensor_checkpoint_on_the_uninterrupted_curve_exactly(tp, env, tmp_path):
    """Saved at iteration 2, resumed and saved again at 4, resumed to 6: the uninterrupted run's losses, bit for
    bit. At DP2 some parameters have an empty shard on one rank (torch's AdamW keeps no state for them); the
    save must not wait forever on the rank that lacks it, and the second save must carry their step as the
    other rank has it."""
    run, directory = Run(tp=tp, steps=6), str(tmp_path / "fsdp_dtensor")
    uninterrupted = run_ranks(2 * tp, train, run, True, env=env)[0]["losses"]
    for start, stop in [(0, 2), (2, 4), (4, 6)]:
        for rank in run_ranks(2 * tp, train_from_checkpoint, run, directory, start, stop, env=env):
            assert rank["losses"] == {i: uninterrupted[i - 1] for i in range(start + 1, stop + 1)}
            assert rank["kernels"] == ("npu_provider" if env else "torch_provider")


def test_the_swiglu_split_finds_a_parameter_under_either_wrapper_spelling_and_nothing_else():
    """Megatron-LM hands ``handle_swiglu_in_state_dict`` the MegatronFSDP module (``module.<layers>``); it asks
    for ``module.module.<layers>`` (the model state's key) and ``module.<layers>`` (the optimizer's)."""
    fsdp = torch.nn.Module()
    fsdp.module = torch.nn.Linear(2, 2)
    model = sharding.swiglu_split_finds_its_parameters(lambda model, *state_dicts: model)(fsdp, {}, None)
    assert model.get_parameter("module.module.weight") is model.get_parameter("module.weight") is fsdp.module.weight
    assert model.module is fsdp.module and dict(model.named_modules()) == dict(fsdp.named_modules())
    for missing in ("module.module.bias_w", "other.weight"):
        with pytest.raises(AttributeError):
            model.get_parameter(missing)


@pytest.mark.multiproc
@pytest.mark.slow
def test_megatron_lm_s_swiglu_split_checkpoint_of_megatron_fsdp_resumes_exactly(tmp_path):
    """Megatron-LM's fsdp_dtensor save of a SwiGLU model (megatron.training's ``preprocess_fsdp_dtensor_state_dict``,
    which the megatron-core wheel ships, handed the MegatronFSDP module as Megatron-LM hands it) at DP2: each
    ``linear_fc1`` saved as its gate and up halves, and a model of another seed loading it resumes the
    uninterrupted losses bit for bit (its weights and Adam moments back in the fused ``linear_fc1``)."""
    for rank in run_ranks(2, swiglu_split_resume, Run(steps=4), str(tmp_path / "swiglu"), 2):
        assert len(rank["resumed"]) == 2
        assert rank["resumed"] == rank["uninterrupted"]
        assert rank["fc1_keys"] == ["model.module.decoder.layers.0.mlp.linear_fc1.weight_v",
                                    "model.module.decoder.layers.0.mlp.linear_fc1.weight_w"]


# torch FSDP2 through megatron (--use-torch-fsdp2): megatron's TorchFullyShardedDataParallel, its device mesh on
# this backend's device type; on the cpu backend, and with the npu kernel provider over the double

@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("tp, env", [(1, None), (2, None), (1, NPU_DOUBLE)], ids=["dp2", "tp2-dp2", "dp2-npu"])
def test_torch_fsdp2_trains_the_distributed_optimizer_curve_on_half_the_bytes(tp, env, ddp_reference):
    run = Run(tp=tp, steps=10)
    reference = ddp_reference(tp) if env is None else run_ranks(2 * tp, train, run, False, env=env)
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


def test_megatron_lm_s_fsdp_assertions_are_one_line_for_the_job_and_others_pass_through():
    def megatron_lm_validate(args):  # its assertions raised as plain Python raises them (pytest rewrites asserts)
        if args.use_torch_fsdp2 and not args.untie_embeddings_and_output_weights:
            raise AssertionError("--use-torch-fsdp2 requires --untie-embeddings-and-output-weights")
        if args.use_megatron_fsdp and args.ckpt_format != "fsdp_dtensor":
            raise AssertionError("Megatron-FSDP requires the `fsdp_dtensor` checkpointing format.")
        if args.ckpt_format == "fsdp_dtensor" and not args.use_megatron_fsdp:
            raise AssertionError("--ckpt-format fsdp_dtensor is only tested with Megatron FSDP.")
        if args.seq_length <= 0:
            raise AssertionError("seq_length must be positive")
        return "validated"

    def asked(**given):
        values = dict(use_torch_fsdp2=False, use_megatron_fsdp=False, untie_embeddings_and_output_weights=True,
                      ckpt_format="torch_dist", seq_length=64)
        return argparse.Namespace(**{**values, **given})

    validate = sharding.fsdp_requirements_in_one_line(megatron_lm_validate)
    with pytest.raises(RefusedSetting, match=r"^--use-torch-fsdp2 requires --untie-embeddings-and-output-weights "
                                             r"\(Megatron-LM's check\)$"):
        validate(asked(use_torch_fsdp2=True, untie_embeddings_and_output_weights=False))
    with pytest.raises(RefusedSetting, match=r"^Megatron-FSDP requires the `fsdp_dtensor` checkpointing format\. "):
        validate(asked(use_megatron_fsdp=True))
    with pytest.raises(RefusedSetting, match=r"^--ckpt-format fsdp_dtensor is only tested with Megatron FSDP"):
        validate(asked(ckpt_format="fsdp_dtensor"))
    with pytest.raises(AssertionError, match="seq_length"):
        validate(asked(use_torch_fsdp2=True, seq_length=0))
    assert validate(asked(use_torch_fsdp2=True)) == "validated"
    assert validate(asked(use_megatron_fsdp=True, ckpt_format="fsdp_dtensor")) == "validated"


# ---- Megatron-LM's own pretrain_gpt.py (needs the checkout) ----

MEGATRON_FSDP = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
                 "--use-distributed-optimizer", "--ckpt-format", "fsdp_dtensor", "--train-iters", "6"]


@pytest.mark.megatron_lm
@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("tp, swiglu", [(1, False), (2, False), (1, True), (2, True)],
                         ids=["dp2", "tp2-dp2", "dp2-swiglu", "tp2-dp2-swiglu"])
def test_megatron_lm_saves_megatron_fsdp_and_resumes_on_the_uninterrupted_curve(tp, swiglu, tmp_path):
    """Megatron-LM's flow at DP2 (and TP2 x DP2), 6 iterations saving every 2, then a run resumed from its
    checkpoint of 2: the uninterrupted losses at 3, 5 and 6 (Megatron-LM logs the mean of the first two
    iterations after a restart as the second). With --swiglu the save splits each ``linear_fc1`` into its gate
    and up halves (``handle_swiglu_in_state_dict``, which Megatron-LM hands a model it cannot look the
    parameters up in: NVIDIA/Megatron-LM issues 2035 and 5265), and the resumed run loads them back into the
    fused weights and their Adam moments."""
    from tests.test_megatron_lm import _checkpoint_at, _losses, _run
    from tests.test_megatron_lm_recipes import TINY

    model = [arg for arg in TINY if swiglu or arg != "--swiglu"]
    flags = [*model, *MEGATRON_FSDP, "--tensor-model-parallel-size", str(tp)]
    whole = _losses(_run(tmp_path, "whole", 2 * tp, [*flags, "--save", "saved", "--save-interval", "2"]))
    load = _checkpoint_at(tmp_path / "saved", 2, tmp_path / "at-2")
    resumed = _losses(_run(tmp_path, "resumed", 2 * tp, [*flags, "--load", str(load)]))
    assert sorted(whole) == [1, 2, 3, 4, 5, 6] and sorted(resumed) == [3, 4, 5, 6]
    assert [resumed[i] for i in (3, 5, 6)] == [whole[i] for i in (3, 5, 6)]


@pytest.mark.megatron_lm
@pytest.mark.multiproc
@pytest.mark.slow
def test_megatron_lm_s_swiglu_split_megatron_fsdp_checkpoint_of_dp2_resumes_at_tp2(tmp_path):
    """What the split is for: the fsdp_dtensor checkpoint of a --swiglu model saved at DP2 loads at TP2, where
    each rank holds the gate and the up rows of its half of the fused ``linear_fc1``; the resumed losses are the
    uninterrupted DP2 run's, within TP2's other order of summing."""
    from tests.test_megatron_lm import _checkpoint_at, _losses, _run
    from tests.test_megatron_lm_recipes import TINY

    flags = [*TINY, *MEGATRON_FSDP]
    whole = _losses(_run(tmp_path, "whole", 2, [*flags, "--save", "saved", "--save-interval", "2"]))
    load = _checkpoint_at(tmp_path / "saved", 2, tmp_path / "at-2")
    resumed = _losses(_run(tmp_path, "tp2", 2, [*flags, "--tensor-model-parallel-size", "2", "--load", str(load)]))
    assert sorted(resumed) == [3, 4, 5, 6]
    assert max(abs(float(resumed[i]) - float(whole[i])) for i in (3, 5, 6)) <= 1e-5

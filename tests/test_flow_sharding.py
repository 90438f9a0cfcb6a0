"""The flow (scripts/pretrain_gpt.py's ``pretrain``) with sharded data parallelism, as Megatron-LM runs it:
``--use-megatron-fsdp`` (megatron's FullyShardedDataParallel, the distributed optimizer, fsdp_dtensor
checkpoints) and ``--use-torch-fsdp2`` (megatron's TorchFullyShardedDataParallel, torch_dist checkpoints). Each
trains the curve of DDP with the distributed optimizer (the reference: the same model, data and seed) while its
ranks hold a shard of what DDP holds whole, and a run resumed from its checkpoint gives the uninterrupted run's
losses bit for bit: at DP2 and TP2 x DP2 on the cpu backend, and with the npu kernel provider over the torch_npu
double. Megatron-LM's checks of the flags are one line each (megatron.training's ``validate_args`` through the
adapter's refusals)."""

from __future__ import annotations

import sys

import pytest

from adapter.cuda_only_features import RefusedSetting
from tests.conftest import DOUBLES
from tests.distributed import launch_script, run_ranks
from tests.flow_ranks import logged_losses, run_pretrain, stopped_at
from tests.flow_sharding_ranks import run_pretrain_measured

# untied: FSDP2 needs it (Megatron-LM's check), and one reference serves both
BASE = ["--model", "qwen2.5-tiny", "--untie-embeddings-and-output-weights", "--micro-batch-size", "1",
        "--global-batch-size", "2", "--seq-length", "16", "--train-iters", "10", "--lr", "3e-3", "--min-lr", "3e-4",
        "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--mock-data", "--log-interval", "1",
        "--eval-interval", "1000", "--eval-iters", "0", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--ddp-bucket-size", "4096", "--seed", "7"]
DDP = ["--use-distributed-optimizer"]
SHARDED = {"megatron-fsdp": ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor"],
           "torch-fsdp2": ["--use-torch-fsdp2"]}
WRAPPERS = {"megatron-fsdp": "FullyShardedDataParallel", "torch-fsdp2": "TorchFullyShardedDataParallel"}
SAVED_AT = 7
# the npu kernel provider on the CPU, over tests/doubles' torch_npu (as tests/test_sharding.py runs it)
NPU_DOUBLE = {"ADAPTER_BACKEND": "cpu", "ADAPTER_KERNELS": "npu", "PYTHONPATH": str(DOUBLES)}

pytestmark = [pytest.mark.multiproc, pytest.mark.megatron_training]  # the reference fixture starts ranks


@pytest.fixture(scope="module")
def reference() -> dict:
    """DDP with the distributed optimizer at DP2: {iteration: loss}, and what rank 0 holds."""
    ranks = run_ranks(2, run_pretrain_measured, [*BASE, *DDP])
    return {"losses": logged_losses(ranks), "held": ranks[0]}


def _train_save_and_resume(kind: str, tmp_path, tp: int = 1, env: dict | None = None, init: tuple[str, ...] = ()):
    """10 iterations of ``kind`` at TP ``tp`` x DP2 saving at SAVED_AT, then a run resumed from that checkpoint:
    (the whole run's ranks, its losses, the resumed run's losses, the checkpoint)."""
    flags = [*BASE, *SHARDED[kind], "--tensor-model-parallel-size", str(tp), *init]
    whole = run_ranks(2 * tp, run_pretrain_measured, [*flags, "--save", str(tmp_path / "saved"),
                                                      "--save-interval", str(SAVED_AT)], env=env)
    at = stopped_at(tmp_path / "saved", SAVED_AT, tmp_path / "at")
    resumed = logged_losses(run_ranks(2 * tp, run_pretrain, [*flags, "--load", str(at)], env=env))
    return whole, logged_losses(whole), resumed, at


@pytest.fixture(scope="module")
def sharded_at_dp2(tmp_path_factory):
    """kind -> ``_train_save_and_resume(kind)`` at DP2, run once for the tests of this module that read it."""
    runs = {}

    def run(kind: str):
        if kind not in runs:
            runs[kind] = _train_save_and_resume(kind, tmp_path_factory.mktemp(kind))
        return runs[kind]

    return run


def _assert_reference_curve_and_exact_resume(losses: dict, resumed: dict, reference: dict) -> None:
    assert sorted(losses) == list(range(1, 11))
    assert max(abs(losses[i] - reference[i]) for i in losses) <= 1e-5, (losses, reference)
    assert resumed == {i: losses[i] for i in range(SAVED_AT + 1, 11)}


@pytest.mark.slow
@pytest.mark.parametrize("kind", SHARDED)
def test_the_flow_trains_the_distributed_optimizer_curve_sharded_and_resumes_exactly(kind, reference, sharded_at_dp2):
    """DP2: the reference curve within 1e-5 on half the parameter and gradient bytes (DP2 shards them, padded
    to megatron's alignment), the optimizer state the distributed optimizer holds; resumed at 7, iterations
    8-10 bit for bit."""
    whole, losses, resumed, _ = sharded_at_dp2(kind)
    _assert_reference_curve_and_exact_resume(losses, resumed, reference["losses"])
    ddp = reference["held"]
    for rank in whole:
        assert rank["wrapper"] == WRAPPERS[kind]
        assert rank["param_bytes"] <= ddp["param_bytes"] / 2 + 4096
        assert rank["grad_bytes"] <= ddp["grad_bytes"] / 2 + 4096
        assert abs(rank["optimizer_bytes"] - ddp["optimizer_bytes"]) <= 4096


@pytest.mark.slow
@pytest.mark.parametrize("kind, tp, env", [("megatron-fsdp", 2, None), ("torch-fsdp2", 1, NPU_DOUBLE)],
                         ids=["megatron-fsdp-tp2-dp2", "torch-fsdp2-dp2-npu-double"])
def test_the_flow_shards_with_tensor_parallelism_and_the_npu_kernels(kind, tp, env, reference, tmp_path):
    """TP2 x DP2 (Megatron-FSDP's DTensors over a TP x DP mesh) and the npu kernel provider (FSDP2): the DP2
    reference curve within 1e-5 (TP and the provider's kernels change the order of sums, not the model, data
    or seed), and the exact resume. Megatron-FSDP's checkpoint of TP2 x DP2 resumes at DP2 (TP1) on the curve:
    its SwiGLU ``linear_fc1`` saved as Megatron-LM saves it, gate and up halves apart (the fused rows of a TP
    rank are its gate rows, then its up rows, so the fused tensor is not one tensor across TP ranks). At TP2 the
    whole weights are drawn on the host and split (Megatron-LM's --use-cpu-initialization, its reference too):
    without it each TP rank draws its shard from a generator of its own."""
    init = ("--use-cpu-initialization",) if tp > 1 else ()
    if init:
        reference = {"losses": logged_losses(run_ranks(2, run_pretrain, [*BASE, *DDP, *init]))}
    whole, losses, resumed, at = _train_save_and_resume(kind, tmp_path, tp, env, init)
    _assert_reference_curve_and_exact_resume(losses, resumed, reference["losses"])
    assert {(rank["wrapper"], rank["kernels"]) for rank in whole} == {
        (WRAPPERS[kind], "npu_provider" if env else "torch_provider")}
    if kind == "megatron-fsdp":
        saved = tmp_path / "saved" / f"iter_{SAVED_AT:07d}"
        assert _fc1_keys(saved, "model.module.decoder.layers.0.mlp.") == ["linear_fc1.weight_v", "linear_fc1.weight_w"]
        at_dp2 = logged_losses(run_ranks(2, run_pretrain, [*BASE, *SHARDED[kind], *init, "--load", str(at)]))
        assert sorted(at_dp2) == list(range(SAVED_AT + 1, 11))
        assert max(abs(at_dp2[i] - losses[i]) for i in at_dp2) <= 1e-5, (at_dp2, losses)


def _fc1_keys(checkpoint, prefix: str) -> list[str]:
    """The keys of the ``linear_fc1`` under ``prefix`` that the checkpoint holds, less ``prefix``."""
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    return sorted(key[len(prefix):] for key in saved if key.startswith(f"{prefix}linear_fc1"))


@pytest.mark.slow
def test_a_moe_model_under_megatron_fsdp_saves_its_experts_split_and_resumes_exactly(tmp_path):
    """A SwiGLU MoE model (8 experts, EP1) at DP2, each rank holding four experts whole and none of the others:
    saved at 2 with every expert's ``linear_fc1`` (weight and Adam moments) split as Megatron-LM splits it, under
    its global index, and resumed on the uninterrupted losses bit for bit."""
    flags = [*BASE, *SHARDED["megatron-fsdp"], "--model", "gpt-tiny-moe", "--train-iters", "4"]
    whole = logged_losses(run_ranks(2, run_pretrain, [*flags, "--save", str(tmp_path / "saved"),
                                                      "--save-interval", "2"]))
    at = stopped_at(tmp_path / "saved", 2, tmp_path / "at")
    resumed = logged_losses(run_ranks(2, run_pretrain, [*flags, "--load", str(at)]))
    assert sorted(whole) == [1, 2, 3, 4]
    assert resumed == {3: whole[3], 4: whole[4]}
    experts = "model.module.decoder.layers.1.mlp.experts.local_experts"
    assert [_fc1_keys(at / "iter_0000002", f"{experts}.{i}.") for i in (0, 7)] == [
        ["linear_fc1.weight_v", "linear_fc1.weight_w"]] * 2



@pytest.mark.slow
def test_megatron_fsdp_s_optim_strategy_without_overlap_trains_the_distributed_optimizer_curve(reference):
    """ZeRO-1 (``optim``) without --overlap-grad-reduce: megatron_fsdp reduce-scatters the whole gradient buffer in
    place in ``finish_grad_sync``; its backward hooks reduce-scatter the buckets as well where a ``no_sync``
    context marked the last micro-batch. The flow once wired ``no_sync`` without overlap (Megatron-LM does not):
    the second reduce-scatter of a buffer already half reduced gave gradient norms 20% low and a curve 3e-3 off."""
    losses = logged_losses(run_ranks(2, run_pretrain, [*BASE, *SHARDED["megatron-fsdp"],
                                                       "--data-parallel-sharding-strategy", "optim"]))
    assert sorted(losses) == list(range(1, 11))
    assert max(abs(losses[i] - reference["losses"][i]) for i in losses) <= 1e-5, (losses, reference["losses"])

# Megatron-LM's checks of the flags (its validate_args), each one line: (arguments, the message's start)
TINY = ["--model", "qwen2.5-tiny", "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "1",
        "--lr", "1e-3", "--mock-data", "--eval-interval", "1000"]
REFUSED = [
    (["--use-megatron-fsdp", "--save", "ckpt"], "Megatron-FSDP requires the `fsdp_dtensor` checkpointing format"),
    (["--ckpt-format", "fsdp_dtensor"], "--ckpt-format fsdp_dtensor is only tested with Megatron FSDP"),
    (["--use-megatron-fsdp", "--use-torch-fsdp2", "--untie-embeddings-and-output-weights", "--ckpt-format",
      "fsdp_dtensor"], "--use-torch-fsdp2 requires --ckpt-format torch_dist or torch_dcp"),  # together: refused
    (["--use-torch-fsdp2"], "--use-torch-fsdp2 requires --untie-embeddings-and-output-weights"),
    (["--use-torch-fsdp2", "--untie-embeddings-and-output-weights", "--use-distributed-optimizer"],
     "--use-torch-fsdp2 is not supported with MCore's distributed optimizer"),
    (["--use-torch-fsdp2", "--untie-embeddings-and-output-weights", "--pipeline-model-parallel-size", "2"],
     "--use-torch-fsdp2 is not supported with pipeline parallelism"),
    (["--use-torch-fsdp2", "--untie-embeddings-and-output-weights", "--fp16"],
     "--use-torch-fsdp2 not supported with fp16"),
]


def _validated(monkeypatch, extra: list[str]):
    """megatron.training's parse_args and validate_args (with the adapter's patches) on ``TINY + extra``,
    ``--model`` expanded as scripts/pretrain_gpt.py expands it, at world size 2."""
    from megatron.training.arguments import parse_args, validate_args

    from flow import model_flags
    from flow.releases import ARGS_DEFAULTS

    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *model_flags.expand([*TINY, *extra])])
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)  # validate_args sets it; FSDP refuses 1
    return validate_args(parse_args(), ARGS_DEFAULTS)


@pytest.mark.parametrize("extra, message", REFUSED, ids=lambda value: value[:40] if isinstance(value, str) else None)
def test_megatron_lm_s_checks_of_sharded_data_parallelism_are_one_line(extra, message, monkeypatch):
    with pytest.raises(RefusedSetting) as refused:
        _validated(monkeypatch, extra)
    assert message in str(refused.value)
    assert "\n" not in str(refused.value)


def test_async_save_with_megatron_fsdp_is_megatron_lm_s_to_decide(monkeypatch):
    """megatron.training saves fsdp_dtensor asynchronously (its torch.distributed.checkpoint writer); the
    project's earlier loop refused --async-save there (torch_dist's only). Taken as Megatron-LM takes it: its
    validate_args turns it off without --use-persistent-ckpt-worker, with a warning, and keeps it with one."""
    flags = ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor", "--async-save"]
    assert _validated(monkeypatch, flags).async_save is False
    args = _validated(monkeypatch, [*flags, "--use-persistent-ckpt-worker"])
    assert (args.ckpt_format, args.async_save) == ("fsdp_dtensor", True)


def test_megatron_fsdp_takes_megatron_lm_s_defaults_and_the_distributed_optimizer(monkeypatch):
    """--data-parallel-sharding-strategy defaults to Megatron-LM's optim_grads_params; Megatron-FSDP runs
    with the distributed optimizer, switched on as Megatron-LM does; FSDP2 reshards after forward unless told."""
    args = _validated(monkeypatch, ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor"])
    assert (args.data_parallel_sharding_strategy, args.use_distributed_optimizer) == ("optim_grads_params", True)
    args = _validated(monkeypatch, ["--use-torch-fsdp2", "--untie-embeddings-and-output-weights",
                                    "--torch-fsdp2-no-reshard-after-forward"])
    assert (args.use_distributed_optimizer, args.torch_fsdp2_reshard_after_forward) == (False, False)


def _refused_load(flags: list[str], load) -> tuple[int, str]:
    """scripts/pretrain_gpt.py on 2 ranks with ``flags`` loading ``load``: rank 0's exit status and last line."""
    argv = [*BASE, *flags, "--train-iters", "3", "--load", str(load), "--distributed-timeout-minutes", "1"]
    status, output = launch_script("scripts/pretrain_gpt.py", argv)[0]
    return status, (output.strip().splitlines() or [""])[-1]


@pytest.mark.slow
def test_a_checkpoint_of_the_other_format_is_refused_in_one_line(sharded_at_dp2):
    """megatron.training tells a checkpoint's format by its files and reads it with that format's state dict,
    which a run of the other format does not hold: a traceback from torch's reader on every rank (an
    AttributeError for Megatron-FSDP's fsdp_dtensor checkpoint in an FSDP2 torch_dist run, a KeyError the
    other way). One line naming the files, the run's --ckpt-format and the flags that read it, exit 2."""
    fsdp_dtensor, torch_dist = (sharded_at_dp2(kind)[3] for kind in ("megatron-fsdp", "torch-fsdp2"))
    saved = f"iter_{SAVED_AT:07d}"
    status, line = _refused_load(SHARDED["torch-fsdp2"], fsdp_dtensor)
    assert status == 2 and line == (
        f"error: --load {fsdp_dtensor}: {saved} holds torch's DCP files without megatron's metadata.json, an "
        "fsdp_dtensor or torch_dcp checkpoint, and this run reads --ckpt-format torch_dist: load it with the flags "
        "that saved it (--use-megatron-fsdp --ckpt-format fsdp_dtensor (Megatron-FSDP's), or --ckpt-format "
        "torch_dcp (FSDP2's))"), line
    status, line = _refused_load(SHARDED["megatron-fsdp"], torch_dist)
    assert status == 2 and line == (
        f"error: --load {torch_dist}: {saved} holds megatron's metadata.json, a torch_dist checkpoint, and this run "
        "reads --ckpt-format fsdp_dtensor: load it with the flags that saved it (--ckpt-format torch_dist, without "
        "--use-megatron-fsdp)"), line


FC1 = "module.decoder.layers.0.mlp.linear_fc1."


@pytest.mark.slow
def test_a_checkpoint_lacking_what_the_run_reads_is_refused_in_one_line(tmp_path):
    """Another model's fsdp_dtensor checkpoint (here one tensor and not megatron's entries): torch's reader
    fails planning on every rank; one line naming the checkpoint, the first entry it lacks and the way out."""
    import torch
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": {f"{FC1}weight": torch.zeros(4, 2)}}, checkpoint_id=str(tmp_path / "iter_0000001"))
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("1")
    status, line = _refused_load(SHARDED["megatron-fsdp"], tmp_path)
    assert status == 2 and line.startswith(f"error: --load {tmp_path}: the checkpoint lacks args, which this run "
                                           "reads") and "load it with the model and flags that saved it" in line, line

"""Megatron-LM's flags the one flow (scripts/pretrain_gpt.py: megatron.training's pretrain) takes with
Megatron-LM's meanings, each against the flow without it on 2 gloo ranks: selective recompute of core
attention and ``--transformer-impl transformer_engine`` (megatron's local spec where TE is not importable)
train the local spec's curve bit for bit, per-token loss the same curve where every micro-batch holds the
same number of tokens, ``--manual-gc`` turns Python's collector off and collects every
``--manual-gc-interval`` iterations, ``--async-save`` writes the synchronous save's checkpoint in the
background and resumes from it. Refusals of the flags the flow lacks: tests/test_flow_arguments.py;
multi-latent attention and MTP: tests/test_deepseek.py."""

from __future__ import annotations

import gc

import pytest
import torch

from tests.distributed import run_ranks
from tests.flow_ranks import logged_losses, run_pretrain, stopped_at

pytestmark = [pytest.mark.multiproc, pytest.mark.slow, pytest.mark.megatron_training]

# DP2, two micro-batches of 2 per rank and step; no dropout, so a recomputed forward is the same forward
ARGV = ["--model", "qwen2.5-tiny", "--micro-batch-size", "2", "--global-batch-size", "8", "--seq-length", "32",
        "--train-iters", "4", "--lr", "3e-3", "--lr-warmup-iters", "1", "--mock-data", "--log-interval", "1",
        "--eval-interval", "1000", "--eval-iters", "0", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--seed", "7"]


@pytest.fixture(scope="module")
def reference() -> dict[int, float]:
    """megatron's local spec (the flow's --transformer-impl default is Megatron-LM's, transformer_engine)."""
    return logged_losses(run_ranks(2, run_pretrain, [*ARGV, "--transformer-impl", "local"]))


def test_selective_recompute_of_core_attention_under_megatron_lms_default_impl_trains_the_same_curve(reference):
    """--recompute-modules reaches megatron's TransformerConfig (core_attn, megatron's default module);
    --transformer-impl transformer_engine without TE runs the adapter's spec and says so once, on rank 0."""
    results = run_ranks(2, run_pretrain, [*ARGV, "--recompute-granularity", "selective",
                                                   "--recompute-modules", "core_attn",
                                                   "--transformer-impl", "transformer_engine"])
    assert logged_losses(results) == reference
    said = [[line for line in r["stdout"].splitlines() if "--transformer-impl transformer_engine" in line]
            for r in results]
    assert len(said[0]) == 1 and said[1] == [], said
    assert "Transformer Engine is not importable" in said[0][0]


def test_per_token_loss_over_equal_micro_batches_trains_the_same_curve(reference):
    """Every micro-batch holds 2 x 32 unmasked tokens, so the mean over the global batch's tokens equals the
    mean of the micro-batch means (up to the order of the float sums)."""
    per_token = logged_losses(run_ranks(2, run_pretrain, [*ARGV, "--calculate-per-token-loss"]))
    assert sorted(per_token) == sorted(reference)
    for iteration, loss in reference.items():
        assert per_token[iteration] == pytest.approx(loss, abs=1e-5)


def pretrain_counting_collections(argv: list[str]) -> dict:
    """run_pretrain, counting the full collections that run while the collector is off (only explicit
    ``gc.collect()`` calls run then; torch.compile's own ``gc.collect(1)`` are not full ones) and whether the
    collector is on again after training."""
    explicit = []

    def note(phase: str, info: dict) -> None:
        if phase == "start" and not gc.isenabled() and info["generation"] == 2:
            explicit.append(info["generation"])

    gc.callbacks.append(note)
    try:
        run_pretrain(argv)
    finally:
        gc.callbacks.remove(note)
    return {"explicit": explicit, "enabled_after": gc.isenabled()}


def test_manual_gc_turns_the_collector_off_and_collects_every_interval():
    """Megatron-LM's meaning: the collector off from the first iteration, one full collection as it goes
    off and one after every --manual-gc-interval-th iteration (4 iterations, interval 2: at 2 and 4); it stays
    off after training, where megatron.training's process ends (the own loop turned it on again)."""
    [manual] = run_ranks(1, pretrain_counting_collections, [*ARGV, "--global-batch-size", "4", "--manual-gc",
                                                            "--manual-gc-interval", "2"])
    assert manual == {"explicit": [2, 2, 2], "enabled_after": False}
    [default] = run_ranks(1, pretrain_counting_collections, [*ARGV, "--global-batch-size", "4"])
    assert default == {"explicit": [], "enabled_after": True}


def pretrain_counting_layers(argv: list[str]) -> dict:
    """run_pretrain, with the number of transformer layers each model chunk megatron built on this rank holds."""
    from megatron.training import training

    built, setup = [], training.setup_model_and_optimizer

    def counting(*args, **kwargs):
        result = setup(*args, **kwargs)
        built.extend(len(chunk.module.decoder.layers) for chunk in result[0])
        return result

    training.setup_model_and_optimizer = counting
    try:
        return {**run_pretrain(argv), "layers": built}
    finally:
        training.setup_model_and_optimizer = setup


PP2 = [*ARGV, "--pipeline-model-parallel-size", "2"]


def test_an_uneven_pipeline_split_builds_the_stages_it_names_and_trains():
    """Megatron-LM's --decoder-first-pipeline-num-layers: 1 layer on the first stage, the other 3 on the
    last, and it trains (each stage draws its initial weights from its own stream, so the curve is not the
    even split's). --account-for-embedding-in-pipeline-split over 5 layers: the embedding counts as one layer
    of the first stage, 2 + 3, the split --decoder-first-pipeline-num-layers 2 gives, bit for bit."""
    uneven = run_ranks(2, pretrain_counting_layers, [*PP2, "--decoder-first-pipeline-num-layers", "1"])
    assert [r["layers"] for r in uneven] == [[1], [3]]
    curve = logged_losses(uneven)
    assert sorted(curve) == [1, 2, 3, 4] and curve[4] < curve[1]
    five = [*PP2, "--num-layers", "5"]
    embedding = run_ranks(2, pretrain_counting_layers, [*five, "--account-for-embedding-in-pipeline-split"])
    first = run_ranks(2, pretrain_counting_layers, [*five, "--decoder-first-pipeline-num-layers", "2"])
    assert [r["layers"] for r in embedding] == [r["layers"] for r in first] == [[2], [3]]
    assert logged_losses(embedding) == logged_losses(first)


def _bytes_by_rank(checkpoint) -> dict[int, int]:
    """Bytes of torch_dist's data files per writing rank (``__<rank>_<n>.distcp``)."""
    sizes: dict[int, int] = {}
    for path in checkpoint.glob("__*.distcp"):
        rank = int(path.name.split("_")[2])
        sizes[rank] = sizes.get(rank, 0) + path.stat().st_size
    return sizes


def test_fully_parallel_save_shares_the_writing_and_a_fully_parallel_load_resumes_bit_exactly(tmp_path):
    """At DP2 both ranks write a part (Megatron-LM's default, a fully parallel save); with
    --no-ckpt-fully-parallel-save the first replica writes the whole model; the checkpoint, read back with
    --ckpt-fully-parallel-load, continues the curve."""
    from adapter import checkpoint_dir

    plain, shared = tmp_path / "plain", tmp_path / "shared"
    run_ranks(2, run_pretrain, [*ARGV, "--train-iters", "2", "--save", str(plain), "--save-interval", "2",
                                "--no-ckpt-fully-parallel-save"])
    reference = logged_losses(run_ranks(2, run_pretrain, [*ARGV, "--save", str(shared), "--save-interval", "2"]))
    alone = _bytes_by_rank(plain / checkpoint_dir.checkpoint_name(2))
    both = _bytes_by_rank(shared / checkpoint_dir.checkpoint_name(2))
    assert alone[0] > 10 * alone.get(1, 0) and min(both[0], both[1]) > sum(both.values()) / 4, (alone, both)
    resumed = logged_losses(run_ranks(2, run_pretrain, [*ARGV, "--load", str(stopped_at(shared, 2, tmp_path / "at2")),
                                                        "--ckpt-fully-parallel-load"]))
    assert resumed == {i: reference[i] for i in (3, 4)}


def test_group_limited_routing_over_every_group_is_plain_top_k_and_over_fewer_routes_otherwise():
    """8 experts, top-2, --moe-router-num-groups 2 --moe-router-group-topk 2: both groups are kept, so
    megatron's router picks the plain top-k (the curve without the flags, bit for bit); --moe-router-group-topk
    1 keeps one group of 4 experts per token, another routing and another curve."""
    moe = [*ARGV, "--model", "qwen3-moe-tiny", "--global-batch-size", "4", "--train-iters", "3"]
    plain = logged_losses(run_ranks(1, run_pretrain, moe))
    grouped = ["--moe-router-num-groups", "2", "--moe-router-group-topk"]
    assert logged_losses(run_ranks(1, run_pretrain, [*moe, *grouped, "2"])) == plain
    assert logged_losses(run_ranks(1, run_pretrain, [*moe, *grouped, "1"])) != plain


def _checkpoint_tensors(checkpoint) -> dict:
    """Every tensor of a torch_dist checkpoint, whole, read on this process."""
    from models.torch_dist_io import checkpoint_reader, read_regions, tensors_metadata

    regions = {key: ((0,) * len(t.global_shape), tuple(t.global_shape), t.dtype)
               for key, t in tensors_metadata(checkpoint).items()}
    return read_regions(checkpoint_reader(checkpoint), regions)


def pretrain_counting_async_saves(argv: list[str]) -> dict:
    """run_pretrain, counting the saves handed to megatron's asynchronous writer (its AsyncCallsQueue)."""
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    scheduled, schedule = [], AsyncCallsQueue.schedule_async_request

    def counting(queue, request):
        scheduled.append(request)
        return schedule(queue, request)

    AsyncCallsQueue.schedule_async_request = counting
    try:
        return {**run_pretrain(argv), "async saves": len(scheduled)}
    finally:
        AsyncCallsQueue.schedule_async_request = schedule


def test_async_save_writes_the_sync_saves_checkpoint_and_resumes_bit_exactly(tmp_path):
    """--async-save (Megatron-LM's meaning): the save is written in the background while training goes on (the
    curve is the one a synchronous save leaves), published once written (both iterations' checkpoints, the
    tracker at the last), holds the same tensors as the synchronous save's, and resumes the curve bit for bit.
    megatron.training (0.17.1 to 0.19.2) saves asynchronously only through its persistent worker
    (--use-persistent-ckpt-worker; without it validate_args turns --async-save off, with a warning), and
    --async-strategy mcore is megatron-core's own writer (the default, nvrx, is nvidia-resiliency-ext's). The
    worker is a spawned process whose target imports the adapter first (adapter.checkpoint_writes): these
    ranks' main module does not, and without it the worker died on an unrouted torch.cuda call while the
    trainer waited on it for good."""
    from adapter import checkpoint_dir

    sync, background = tmp_path / "sync", tmp_path / "async"
    saving = ["--save-interval", "2", "--use-distributed-optimizer"]
    synchronous = run_ranks(2, pretrain_counting_async_saves, [*ARGV, "--save", str(sync), *saving])
    asynchronous = run_ranks(2, pretrain_counting_async_saves, [*ARGV, "--save", str(background), *saving,
                                                                "--async-save", "--use-persistent-ckpt-worker",
                                                                "--async-strategy", "mcore"])
    assert [r["async saves"] for r in synchronous] == [0, 0] and [r["async saves"] for r in asynchronous] == [2, 2]
    reference = logged_losses(synchronous)
    assert logged_losses(asynchronous) == reference
    assert (background / checkpoint_dir.TRACKER).read_text().strip() == "4"
    assert sorted(p.name for p in background.iterdir() if p.is_dir()) == [checkpoint_dir.checkpoint_name(i)
                                                                         for i in (2, 4)]
    for iteration in (2, 4):
        ours = _checkpoint_tensors(background / checkpoint_dir.checkpoint_name(iteration))
        theirs = _checkpoint_tensors(sync / checkpoint_dir.checkpoint_name(iteration))
        assert sorted(ours) == sorted(theirs) and len(ours) > 10
        assert [key for key in ours if not torch.equal(ours[key], theirs[key])] == [], iteration
    resumed = logged_losses(run_ranks(2, run_pretrain, [*ARGV, "--use-distributed-optimizer", "--load",
                                                        str(stopped_at(background, 2, tmp_path / "at2"))]))
    assert resumed == {i: reference[i] for i in (3, 4)}

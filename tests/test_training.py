"""The tiny GPT trained through megatron-core on CPU/gloo: TP, PP, VPP, DP, DDP overlap, the distributed
optimizer, dropout under the RNG tracker, and dist_checkpointing — real processes, real collectives."""

import logging

import pytest

from tests.distributed import run_ranks
from scripts.train_tiny_gpt import Run, train
from tests.checkpointing import checkpoint_round_trip

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]


@pytest.fixture(scope="module")
def single_process():
    """TP1, one process, global batch 8 in 4 micro-batches: the reference curve."""
    return run_ranks(1, train, Run())[0]


def _curve(results):
    """The loss curve, checking that every rank that reports one reports the same."""
    curves = [r["losses"] for r in results if r["losses"][0] is not None]
    assert curves and all(c == curves[0] for c in curves)
    return curves[0]


def test_tensor_parallel_curve_equals_single_process(single_process):
    tp2 = _curve(run_ranks(2, train, Run(tp=2)))
    assert tp2 == pytest.approx(single_process["losses"], abs=1e-5)


def test_tensor_and_sequence_parallel_curve_equals_single_process(single_process):
    """Megatron's local norm refuses sequence parallelism; the adapter's norm takes it."""
    tp2_sp = _curve(run_ranks(2, train, Run(tp=2, sequence_parallel=True)))
    assert tp2_sp == pytest.approx(single_process["losses"], abs=1e-5)


def test_data_parallel_distributed_optimizer_matches_single_process_and_halves_state(single_process):
    results = run_ranks(2, train, Run(distributed_optimizer=True))
    assert _curve(results) == pytest.approx(single_process["losses"], abs=1e-5)
    total = single_process["optimizer_state_bytes"]
    for rank in results:
        assert rank["dp_size"] == 2
        assert rank["optimizer_state_bytes"] == pytest.approx(total / 2, rel=0.05)
    assert sum(r["optimizer_state_bytes"] for r in results) == pytest.approx(total, rel=0.01)


def test_tensor_and_pipeline_parallel_with_distributed_optimizer_learns():
    results = run_ranks(4, train, Run(tp=2, pp=2, distributed_optimizer=True))
    losses = _curve(results)
    assert [r["losses"][0] is None for r in results] == [True, True, False, False]  # first stage
    assert losses[-1] < losses[0] - 0.5
    # megatron's Timers synchronised the device and gathered times from all 4 ranks (rank 0 holds them)
    assert "forward-backward" in results[0]["timings"] and "optimizer" in results[0]["timings"]


def test_tied_embeddings_across_pipeline_stages_stay_equal():
    """Megatron all-reduces the tied weight between first and last stage (its .cuda() site)."""
    results = run_ranks(2, train, Run(pp=2, flavor="gpt-tiny-tied", steps=4))
    losses = _curve(results)
    assert losses[-1] < losses[0]
    first, last = results[0]["shared_weight"], results[1]["shared_weight"]
    assert first.shape == last.shape and (first == last).all()


def test_interleaved_pipeline_learns():
    losses = _curve(run_ranks(2, train, Run(pp=2, vpp=2)))
    assert losses[-1] < losses[0] - 0.4


def dropout_run(run: Run) -> dict:
    """Train with dropout, recording what megatron's RNG tracker logs."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("megatron.core.tensor_parallel.random").addHandler(handler)
    result = train(run)
    result["rng_warnings"] = [r.getMessage() for r in records]
    return result


def test_dropout_under_the_rng_tracker_with_tensor_parallel(single_process):
    results = run_ranks(2, dropout_run, Run(tp=2, dropout=0.1, steps=3))
    losses = _curve(results)  # TP ranks draw the same dropout where they must: identical losses
    assert losses[0] != pytest.approx(single_process["losses"][0], abs=1e-4)  # dropout did act
    assert all(r["rng_warnings"] == [] for r in results)


@pytest.mark.parametrize("sharding, bucket_size", [
    ("dp_reshardable", 4096),
    ("fully_reshardable", None),
    # several padded buckets: megatron-core 0.16.1 alone gives parameters their neighbours' state here
    # (patches/distrib_optimizer_checkpoint.py)
    ("fully_reshardable", 4096),
])
def test_dist_checkpoint_round_trip_with_optimizer_state_under_tp2(tmp_path, sharding, bucket_size):
    run = Run(tp=2, steps=3, distributed_optimizer=True, bucket_size=bucket_size)
    for rank in run_ranks(2, checkpoint_round_trip, run, str(tmp_path), sharding):
        assert rank["differs_before"]  # the second model really started elsewhere
        assert rank["params_equal"] and rank["optimizer_equal"]  # params, Adam moments and steps
        original, restored = rank["next_loss"]
        assert original == restored

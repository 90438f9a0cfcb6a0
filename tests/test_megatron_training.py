"""Patches to megatron.training that need no Megatron-LM checkout: megatron-core 0.17+ ships
megatron.training in its wheel, so what a user of the wheel meets is tested against the wheel."""

from __future__ import annotations

import time

import pytest
import torch

import adapter


def test_activation_logging_hooks_the_layers_a_model_holds_without_transformer_engine():
    """megatron.training's activation logging (new in 0.18: in the wheel, or in a checkout) over a model, where
    Transformer Engine is absent and ``LINEAR_TYPES`` lists TE's placeholders: megatron's own
    ``_register_hooks`` raises TypeError there; through the adapter the Linear is hooked."""
    activation_logging = pytest.importorskip("megatron.training.activation_logging",
                                             reason="megatron.training has no activation logging before 0.18")
    if all(isinstance(t, type) for t in activation_logging.LINEAR_TYPES):
        pytest.skip("Transformer Engine is installed: LINEAR_TYPES holds its classes")
    assert adapter.registry.status("megatron.training.activation_logging:_register_hooks") == "applied"
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    seen = []
    hooks = activation_logging._register_hooks([model], activation_logging.LINEAR_TYPES,
                                               lambda chunk, name: lambda *args: seen.append((chunk, name)))
    model(torch.ones(1, 2))
    assert seen == [("model_chunk0", "0")] and len(hooks) == 1


@pytest.mark.multiproc
@pytest.mark.slow
def test_megatron_training_initialize_starts_the_watch_a_stalled_peer_ends_with_the_line():
    """megatron.training's own ``_initialize_distributed`` (wrapped: patches/liveness.py) starts the watch
    with its --distributed-timeout-minutes: rank 1 stalls after it, and rank 0, waiting in an all-reduce on
    megatron's tensor-parallel group, ends within the timeout (3 s) with the one line naming the collective,
    the group, its ranks and rank 1. megatron.training alone leaves it to gloo's own timeout, whose error
    names no group."""
    from tests.distributed import hang_seconds, launch_ranks
    from tests.megatron_training_ranks import stall_after_initialize

    pytest.importorskip("megatron.training.initialize", reason="megatron.training ships in the wheel from 0.17")
    ended = launch_ranks(2, stall_after_initialize, 0.05, env={"ADAPTER_BACKEND": "cpu"}, timeout=60)
    assert ended[0]["status"] == 1, ended[0]["log"][-3000:]
    line = ended[0]["log"].strip().splitlines()[-1]
    seconds = hang_seconds(line, r"error: rank 0: all_reduce on the tensor model parallel group \(ranks \[0, 1\]\) "
                           r"TIMED_OUT \(--distributed-timeout-minutes 0.05\): rank 1 did not arrive; ending this "
                           r"process")
    # the seconds the watcher measured: the timeout, or up to 3 s past it where a loaded machine runs it late
    assert seconds is not None and 2 <= seconds <= 6, ended[0]["log"][-3000:]
    assert "the all-reduce returned" not in ended[0]["log"]


@pytest.mark.multiproc
def test_megatron_training_train_step_stops_on_a_nan_loss_in_one_line_and_never_saves_nan_weights(tmp_path):
    """megatron.training's ``train_step`` with its rerun state machine validating results (what
    ``--check-for-nan-in-loss-and-grad`` sets): a NaN loss at iteration 3 is re-run in place. Reproduced,
    megatron asks for a checkpoint of iteration 2 and exit 16 (its re-run on another GPU), which stands when
    the weights are finite and is dropped (exit 17) where one is NaN; not reproduced, exit 17 with nothing
    saved. Each with the line naming the iteration, the value and what to do."""
    from tests.distributed import run_ranks
    from tests.megatron_training_ranks import nonfinite_step

    pytest.importorskip("megatron.training.training", reason="megatron.training ships in the wheel from 0.17")
    [outcomes] = run_ranks(1, nonfinite_step, str(tmp_path), env={"ADAPTER_BACKEND": "cpu"}, timeout=120)
    found = "iteration 3: the loss is nan on rank 0 (found NaN in local forward loss calculation); "
    decision, line = outcomes["reproduced"]
    assert decision == [True, True, 16]
    assert line == (f"{found}a re-run gave it again: the training diverged (lower --lr, now 0.001) or this device "
                    f"is faulty. Megatron-LM saved iteration 2 to {tmp_path} with its re-run state: loaded on another "
                    f"device it re-runs iteration 3 to tell which (on this one it exits 16 again); to train on, "
                    f"resume from a checkpoint saved before the loss diverged")
    decision, line = outcomes["nan weight"]
    assert decision == [False, True, 17]
    assert line.startswith(found) and line.endswith("The weights are not finite: nothing was saved after iteration 2")
    decision, line = outcomes["transient"]
    assert decision == [False, True, 17]
    assert line == (f"{found}a re-run of the step gave another result: a transient fault. Nothing was saved after "
                    f"iteration 2: resume from the last checkpoint")


@pytest.mark.multiproc
def test_megatron_training_exit_signal_stop_says_the_iteration_and_where_it_is_saved(tmp_path):
    """megatron.training's ``--exit-signal-handler``: with SIGTERM received, ``checkpoint_and_decide_exit``
    saves the iteration (when --save is given) and stops the run; the adapter's line says so, as the old flow
    did (tests/test_resilience.py runs it end to end through scripts/launch.py)."""
    from tests.distributed import run_ranks
    from tests.megatron_training_ranks import exit_signal_stop

    pytest.importorskip("megatron.training.training", reason="megatron.training ships in the wheel from 0.17")
    [outcomes] = run_ranks(1, exit_signal_stop, str(tmp_path), env={"ADAPTER_BACKEND": "cpu"}, timeout=120)
    assert outcomes == {
        "nothing received": (False, [], []),
        "SIGTERM": (True, [5], [f"[adapter] stopped after iteration 5: SIGTERM received; saved in {tmp_path}, "
                                "resume with --load"]),
        "SIGTERM without --save": (True, [], ["[adapter] stopped after iteration 5: SIGTERM received; not saved: "
                                              "no --save"])}


def test_the_start_up_line_builds_on_megatrons_timestamps_once_and_bench_startup_parses_it(monkeypatch, capsys):
    """After a process's first ``train_step`` (patches/startup_clock.py): the time from the process's start,
    in the phases megatron.training's ``set_startup_timestamps`` and ``pretrain`` marked; said once, by the last
    rank; the line is the one bench/startup.py reads."""
    training = pytest.importorskip("megatron.training.training", reason="megatron.training ships in the wheel "
                                                                        "from 0.17")
    from adapter import startup_clock
    from bench.startup import PHASES
    from patches import startup_clock as patch

    start = startup_clock.process_start()
    monkeypatch.setattr(training, "_STARTUP_TIMESTAMPS", {"program_start": start + 0.5, "main_entry": start + 2,
                                                          "pretrain_entry": start + 3})
    assert patch._phases(start + 10, start + 12) == pytest.approx(
        {"imports": 2, "setup": 1, "initialize, model and data": 7, "first iteration": 2})
    monkeypatch.setattr(training, "_STARTUP_TIMESTAMPS", {"program_start": None, "main_entry": None,
                                                          "pretrain_entry": start + 3})  # no entry script's stamps
    assert patch._phases(start + 10, start + 12) == pytest.approx(
        {"setup": 3, "initialize, model and data": 7, "first iteration": 2})
    monkeypatch.setattr(patch, "_said", [])
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 1)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
    step = patch.said_after_first(lambda *args: "result")
    assert [step(), step()] == ["result", "result"]
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("[adapter] time from launch to the end of the first iteration: ")
    found = PHASES.search(lines[0])
    assert found and found.group(2).startswith("setup 3.0 s, initialize, model and data ")
    assert float(found.group(1)) == pytest.approx(time.time() - start, abs=0.2)


@pytest.mark.multiproc
def test_megatron_training_log_says_the_expert_load_its_routers_were_counted():
    """megatron.training's own ``training_log`` (wrapped: patches/expert_load.py) over two real megatron routers
    (8 experts, top 2): after megatron's line, the last rank says the expert load over the training forwards
    since the last line (max/mean tokens per expert, the mean over the layers and the worst layer), counted
    against the top-2 experts of megatron's own gating over the inputs (evaluation and no-autograd forwards
    left out), with its TensorBoard scalars. Iteration 1 is megatron's first line and does not start the count
    anew (as megatron's own totals). A dense model's setup leaves no count."""
    from tests.distributed import run_ranks
    from tests.megatron_training_ranks import expert_load_log

    pytest.importorskip("megatron.training.training", reason="megatron.training ships in the wheel from 0.17")
    for target in ("setup_model_and_optimizer", "training_log"):
        assert adapter.registry.status(f"megatron.training.training:{target}") == "applied"
    [ran] = run_ranks(1, expert_load_log, 8, 2, env={"ADAPTER_BACKEND": "cpu"}, timeout=120)
    for iteration, forwards in ((1, ran["chosen"][:2]), (2, ran["chosen"])):
        tokens = {0: torch.zeros(8), 1: torch.zeros(8)}
        for layer_number, experts in forwards:
            tokens[layer_number - 1] += torch.bincount(torch.tensor(experts), minlength=8)
        load = {layer: (count.max() / count.mean()).item() for layer, count in tokens.items()}
        worst = max(load, key=load.get)
        lines = ran["printed"][iteration].splitlines()
        assert f"iteration {iteration:8d}/" in lines[-2]
        assert lines[-1] == (f"[adapter] iteration {iteration:8d} | expert load max/mean: "
                             f"{sum(load.values()) / 2:.3f} (worst: layer {worst} {load[worst]:.3f}) |")
        scalars = ran["scalars"]
        assert scalars["expert-load-max-over-mean"][iteration] == pytest.approx(sum(load.values()) / 2)
        for layer, value in load.items():
            assert scalars[f"moe/expert_load_max_over_mean_layer_{layer}"][iteration] == pytest.approx(value)
            for expert in range(8):
                assert scalars[f"moe/tokens_per_expert_layer_{layer}/expert_{expert}"][iteration] == pytest.approx(
                    (tokens[layer][expert] / tokens[layer].sum()).item())
    assert ran["dense"] == []

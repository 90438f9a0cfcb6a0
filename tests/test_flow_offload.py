"""The flow's optimizer offloading (``--optimizer-cpu-offload``) and fine-grained activation offloading
(``--fine-grained-activation-offloading``), Megatron-LM's flags through scripts/pretrain_gpt.py (megatron.training's
``pretrain`` with the adapter's patches), against the same run without them: on the cpu backend under the host
stand-in (``adapter.host_memory``: host copies told apart as on an NPU) at DP2, DP2 on the npu kernel
provider over the torch_npu double, and TP2 x DP2, the tiny Qwen (bf16, distributed optimizer) trains the
reference's loss curve over 10 iterations, bit for bit, while the optimizer's state lies on the host as the
offload fraction says and megatron's offload manager reports the bytes it offloaded. What cannot run is
refused in the one line megatron-core's own config (with the adapter's patches) gives. The mechanisms
themselves, through megatron-core directly: tests/test_host_offload.py and tests/test_activation_offload.py."""

from __future__ import annotations

import pytest

import adapter  # noqa: F401 - routing and the patch table before megatron
from adapter import backend, host_memory
from tests.distributed import launch_script, run_ranks
from tests.flow_offload_ranks import run_pretrain_offloading
from tests.flow_ranks import logged_losses
from tests.test_sharding import NPU_DOUBLE

# bf16 with the distributed optimizer, as megatron's HybridDeviceOptimizer takes it; one micro-batch per rank
ARGV = ["--model", "qwen2.5-tiny", "--micro-batch-size", "2", "--global-batch-size", "4", "--seq-length", "32",
        "--train-iters", "10", "--lr", "3e-3", "--lr-warmup-iters", "1", "--mock-data", "--log-interval", "1",
        "--eval-iters", "0", "--eval-interval", "1000", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--seed", "7", "--bf16", "--use-distributed-optimizer"]
OPTIMIZER_OFFLOAD = ["--optimizer-cpu-offload", "--use-precision-aware-optimizer", "--optimizer-offload-fraction"]
ACTIVATION_OFFLOAD = ["--fine-grained-activation-offloading", "--offload-modules", "attn_norm", "qkv_linear",
                      "core_attn", "attn_proj", "mlp_norm", "--min-offloaded-tensor-size", "0"]
STAND_IN = {host_memory.STAND_IN_ENV: "1"}
# layout -> (ranks, arguments, environment)
LAYOUTS = {"dp2": (2, [], STAND_IN), "dp2-npu": (2, [], {**NPU_DOUBLE, **STAND_IN}),
           "tp2-dp2": (4, ["--tensor-model-parallel-size", "2"], STAND_IN)}

pytestmark = [pytest.mark.multiproc, pytest.mark.slow, pytest.mark.megatron_training]
on_cpu = pytest.mark.skipif(backend.current().name != "cpu", reason="the host stand-in is the cpu backend's")


def _train(layout: str, extra: list[str]) -> list[dict]:
    ranks, argv, env = LAYOUTS[layout]
    return run_ranks(ranks, run_pretrain_offloading, [*ARGV, *argv, *extra], env=env)


@pytest.fixture(scope="module")
def reference():
    """layout -> its run without offloading, trained once for every test that compares with it."""
    runs = {}

    def run(layout: str) -> list[dict]:
        if layout not in runs:
            runs[layout] = _train(layout, [])
        return runs[layout]

    return run


def _state_on_the_host(without: dict, offloaded: dict, fraction: float) -> None:
    """The offloaded run holds the reference's state bytes, ``fraction`` of them (by whole parameters, so
    up to a tenth more) on the host."""
    total = without["device_state_bytes"]
    assert (without["host_state_bytes"], offloaded["device_state_bytes"] + offloaded["host_state_bytes"]) == (0, total)
    host_share = offloaded["host_state_bytes"] / total
    assert host_share == 1.0 if fraction == 1.0 else fraction <= host_share < fraction + 0.1, host_share


@on_cpu
@pytest.mark.parametrize("layout, fractions", [("dp2", (0.5, 1.0)), ("dp2-npu", (0.5,)), ("tp2-dp2", (0.5,))])
def test_optimizer_offloading_trains_the_curve_without_it_with_its_state_on_the_host(layout, fractions, reference):
    without = reference(layout)
    for fraction in fractions:
        offloaded = _train(layout, [*OPTIMIZER_OFFLOAD, str(fraction)])
        assert logged_losses(offloaded) == logged_losses(without) and len(logged_losses(without)) == 10
        for ref, rank in zip(without, offloaded):
            assert rank["hybrid"] and not ref["hybrid"]
            _state_on_the_host(ref, rank, fraction)


@on_cpu
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_activation_offloading_trains_the_curve_without_it(layout, reference):
    offloaded = _train(layout, ACTIVATION_OFFLOAD)
    assert logged_losses(offloaded) == logged_losses(reference(layout))
    assert all(rank["offloaded_bytes"] > 0 for rank in offloaded)


def _megatron_core_refusal(**fields) -> str:
    """What megatron-core's OptimizerConfig (with the adapter's patches) says to these fields."""
    from megatron.core.optimizer import OptimizerConfig

    with pytest.raises(ValueError) as refused:
        OptimizerConfig(optimizer_cpu_offload=True, use_precision_aware_optimizer=True, use_distributed_optimizer=True,
                        optimizer_offload_fraction=1.0, **fields)
    return str(refused.value)


def _refused_line(argv: list[str], stand_in: bool) -> str:
    """The one ``error:`` line scripts/pretrain_gpt.py stops with on 2 ranks (exit 2 on each, no traceback),
    under the host stand-in or not."""
    env = {host_memory.STAND_IN_ENV: "1"} if stand_in else {host_memory.STAND_IN_ENV: ""}
    ranks = launch_script("scripts/pretrain_gpt.py", [*argv, "--distributed-timeout-minutes", "1"], env=env)
    output = "".join(output for _, output in ranks)
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert [status for status, _ in ranks] == [2, 2] and len(errors) == 1, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    return errors[0].removeprefix("error: ")


@on_cpu
def test_offloading_on_a_real_cpu_run_is_refused_in_megatron_cores_line():
    assert _refused_line([*ARGV, *OPTIMIZER_OFFLOAD, "1.0"], False) == _megatron_core_refusal(bf16=True)


@on_cpu
def test_offloading_float32_parameters_is_refused_in_megatron_cores_line(monkeypatch):
    monkeypatch.setenv(host_memory.STAND_IN_ENV, "1")  # megatron-core's line here as the ranks' under the stand-in
    float32 = [arg for arg in ARGV if arg != "--bf16"]
    line = _refused_line([*float32, *OPTIMIZER_OFFLOAD, "1.0"], True)
    assert line == _megatron_core_refusal() and "--bf16" in line


@pytest.mark.parametrize("argv, line", [
    (["--optimizer-cpu-offload"], "--optimizer-cpu-offload, without --use-precision-aware-optimizer"),
    ([*OPTIMIZER_OFFLOAD, "1.5"], "--optimizer-offload-fraction 1.5: the share of the optimizer's state kept on "
                                  "the host, from 0 to 1"),  # the adapter's: megatron trains it as 1
    (["--fine-grained-activation-offloading"], "--offload-modules"),
    (["--fine-grained-activation-offloading", "--offload-modules", "attn_proj"],
     "attn_proj cannot be set to offload_modules alone without core_attn"),
], ids=["no-precision-aware", "fraction", "no-modules", "attn-proj-alone"])
def test_what_megatron_lm_refuses_is_refused_in_one_line(argv, line):
    assert line in _refused_line([*ARGV, *argv], True)

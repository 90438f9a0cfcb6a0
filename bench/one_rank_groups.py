"""One-rank process groups answered on the calling thread (adapter/one_rank_groups.py) against gloo's own, on
the CPU, side by side.

``calls``: microseconds per call of the collectives megatron makes over its one-rank groups (an all-reduce of
a loss or a norm, the distributed optimizer's in-place bucket reduce-scatter and all-gather), on a gloo group
of one rank and on the adapter's, interleaved in one process, at a small and a bucket-sized tensor.

``flow``: the tiny MoE flow's ``train_step`` (bench/moe.py's ``tiny`` shape, one process, mock data), its
median milliseconds with megatron's one-rank groups made the adapter's and with them left to gloo, each in
a fresh interpreter, taking turns.

Usage: python bench/one_rank_groups.py [calls|flow|all] [--rounds 4] [--steps 200]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _per_call_us(call, repeats: int) -> float:
    for _ in range(20):
        call()
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    return 1e6 * (time.perf_counter() - start) / repeats


def bench_calls(rounds: int) -> dict:
    """Median microseconds per call, per (collective, size, group kind)."""
    import torch
    import torch.distributed as dist

    from adapter import one_rank_groups

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29571"))
    dist.init_process_group("gloo", rank=0, world_size=1)
    groups = {"gloo": dist.new_group([0], backend="gloo"),
              "adapter": dist.new_group([0], backend=one_rank_groups.registered())}
    results = {}
    for numel in (256, 4 << 20):
        data = torch.ones(numel)
        calls = {"all_reduce": lambda g: dist.all_reduce(data, group=g),
                 "reduce_scatter_tensor (in place)": lambda g: dist.reduce_scatter_tensor(data, data, group=g),
                 "all_gather_into_tensor (in place)": lambda g: dist.all_gather_into_tensor(data, data, group=g)}
        for name, call in calls.items():
            for kind, group in groups.items():
                times = [_per_call_us(lambda: call(group), 200 if numel < 4096 else 20) for _ in range(rounds)]
                results[f"{name}, {numel * 4 // 1024} KiB, {kind}"] = statistics.median(times)
    dist.destroy_process_group()
    return results


def print_calls(results: dict) -> None:
    print("one-rank collectives, microseconds per call (median of rounds):")
    for key in [k for k in results if k.endswith(", gloo")]:
        base = key[:-len(", gloo")]
        gloo, mine = results[key], results[f"{base}, adapter"]
        print(f"  {base:<48} gloo {gloo:9.1f}   adapter {mine:7.1f}   gloo / adapter {gloo / mine:6.1f}")


def flow_child(steps: int, gloo_groups: bool) -> float:
    """The median ms of the tiny MoE flow's train_step after 10 warm-up steps."""
    import bench.moe as moe

    moe.MOE.update(moe.SHAPES["tiny"])
    moe._SHAPE[0] = "tiny"
    if gloo_groups:
        os.environ["ADAPTER_ONE_RANK_GROUPS"] = "none"
    from bench.gpu_train import StepClock, timed_flow

    clock = StepClock("cpu", 10, None)
    timed_flow(moe._flow_argv(steps, 10) + ["--log-interval", str(steps + 10)], clock)
    return 1e3 * statistics.median(clock.seconds)


def bench_flow(rounds: int, steps: int) -> dict:
    results = {"adapter": [], "gloo": []}
    for round_ in range(rounds):
        for kind in (("adapter", "gloo") if round_ % 2 == 0 else ("gloo", "adapter")):
            done = subprocess.run([sys.executable, __file__, "--child", kind, "--steps", str(steps)], cwd=ROOT,
                                  capture_output=True, text=True)
            lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            if done.returncode != 0 or not lines:
                raise SystemExit(f"{kind} run failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
            results[kind].append(json.loads(lines[-1][len("RESULT "):]))
    return results


def print_flow(results: dict, steps: int) -> None:
    mine, gloo = statistics.median(results["adapter"]), statistics.median(results["gloo"])
    print(f"tiny MoE flow, train_step median ms over {steps} steps, {len(results['gloo'])} rounds taking turns:")
    print(f"  one-rank groups the adapter's {mine:.2f} ms ({', '.join(f'{v:.2f}' for v in results['adapter'])})")
    print(f"  one-rank groups gloo's        {gloo:.2f} ms ({', '.join(f'{v:.2f}' for v in results['gloo'])})")
    print(f"  gloo / adapter (time) {gloo / mine:.3f}; adapter faster in "
          f"{sum(m < g for m, g in zip(results['adapter'], results['gloo']))} of {len(results['gloo'])} rounds")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", nargs="?", choices=["calls", "flow", "all"], default="all")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--child", choices=["adapter", "gloo"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(flow_child(args.steps, args.child == "gloo")))
        return
    if args.what in ("calls", "all"):
        print_calls(bench_calls(args.rounds))
    if args.what in ("flow", "all"):
        print_flow(bench_flow(args.rounds, args.steps), args.steps)


if __name__ == "__main__":
    main()

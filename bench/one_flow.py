"""The one flow against the project's own loop (issue 50 point 8): the same flags through
``scripts/pretrain_gpt.py`` (megatron.training's own ``pretrain``) and through ``bench/pretrain_gpt_own.py``
(today's loop, ``adapter/training``, until it is removed), one rank each, in fresh interpreters taking turns
(``--rounds`` of each, the order alternating, so drift on the machine hits both alike).

Per run, two numbers:

- time to the first iteration: wall clock from starting the interpreter to the first iteration's log line
  (both print Megatron-LM's ``iteration 1/ N | ...`` line), so imports, initialization, the model, the
  optimizer and the data are all in it;
- training speed: tokens/s from the ``elapsed time per iteration (ms)`` both loops log, the best and the
  median over the iterations after ``--warmup``.

It prints both flows' figures and the ratios one flow / own loop (above 1 is faster for tokens/s, below 1
is faster for start-up). A benchmark, not a test: exits 0 whatever the ratios; 1 when a run fails.

Usage: python bench/one_flow.py [--rounds 2] [--iters 8] [--warmup 3] [--shape tiny|gemm]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENTRIES = {"one flow": ROOT / "scripts" / "pretrain_gpt.py", "own loop": ROOT / "bench" / "pretrain_gpt_own.py"}
ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*elapsed time per iteration \(ms\): ([0-9.]+)")
# flags both parsers take with the same meaning; dropout off, no evaluation, no checkpoint
COMMON = ["--micro-batch-size", "4", "--global-batch-size", "4", "--lr", "1e-4", "--min-lr", "1e-5",
          "--mock-data", "--tokenizer-type", "NullTokenizer", "--log-interval", "1", "--eval-iters", "0",
          "--eval-interval", "100000", "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "1234",
          "--transformer-impl", "local", "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type",
          "rope", "--disable-bias-linear", "--add-qkv-bias", "--group-query-attention"]
SHAPES = {  # (flags, tokens per iteration)
    # bench/train_throughput.py's GEMM-bound Qwen2 shape
    "gemm": (["--num-layers", "4", "--hidden-size", "1024", "--ffn-hidden-size", "2816", "--num-attention-heads",
              "16", "--num-query-groups", "4", "--vocab-size", "8191", "--seq-length", "512",
              "--max-position-embeddings", "512"], 4 * 512),
    # the README's tiny model: start-up dominates
    "tiny": (["--num-layers", "4", "--hidden-size", "64", "--ffn-hidden-size", "176", "--num-attention-heads", "4",
              "--num-query-groups", "2", "--vocab-size", "1023", "--seq-length", "64",
              "--max-position-embeddings", "64"], 4 * 64),
}


def run(entry: Path, flags: list[str], iters: int) -> tuple[float, list[float]]:
    """(seconds to the first iteration's line, per-iteration ms) of one single-rank run of ``entry``."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29500 + os.getpid() % 1000),
           "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "OMP_NUM_THREADS": "2"}
    with tempfile.TemporaryDirectory() as cache:
        argv = [sys.executable, str(entry), *flags, "--train-iters", str(iters), "--data-cache-path", cache]
        start, first, times = time.perf_counter(), None, []
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        tail = []
        for line in proc.stdout:
            tail = (tail + [line])[-40:]
            found = ITERATION.search(line)
            if found:
                first = first or time.perf_counter() - start
                times.append(float(found.group(2)))
        if proc.wait() != 0 or len(times) != iters:
            raise SystemExit(f"{entry.name} failed ({proc.returncode}):\n{''.join(tail)}")
    return first, times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="gemm")
    args = parser.parse_args(argv)
    shape, tokens = SHAPES[args.shape]
    starts, rates = {name: [] for name in ENTRIES}, {name: [] for name in ENTRIES}
    for round_ in range(args.rounds):
        order = list(ENTRIES) if round_ % 2 == 0 else list(reversed(ENTRIES))
        for name in order:
            first, times = run(ENTRIES[name], COMMON + shape, args.iters)
            starts[name].append(first)
            rates[name] += [tokens / (ms / 1000) for ms in times[args.warmup:]]
            print(f"round {round_ + 1} {name}: first iteration after {first:.1f} s, "
                  f"{statistics.median(times[args.warmup:]):.0f} ms per iteration", flush=True)
    print(f"\nshape {args.shape}, 1 rank, {args.rounds} rounds x {args.iters} iterations ({args.warmup} warm-up)")
    for name in ENTRIES:
        print(f"{name:9s} first iteration {min(starts[name]):6.1f} s (best) | tokens/s best "
              f"{max(rates[name]):8.0f}, median {statistics.median(rates[name]):8.0f}")
    one, own = "one flow", "own loop"
    print(f"ratio one flow / own loop: time to first iteration {min(starts[one]) / min(starts[own]):.2f}, "
          f"tokens/s best {max(rates[one]) / max(rates[own]):.2f}, "
          f"median {statistics.median(rates[one]) / statistics.median(rates[own]):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

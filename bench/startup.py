"""Start-up of the pretrain flow: launch to the end of its first iteration, against the same launcher only
importing torch and megatron-core.

Two kinds of run, interleaved round by round (the order alternating, so drift on the machine hits both):

- ``imports``: ``torchrun --nproc_per_node 1`` of a script that imports torch and the megatron-core
  modules every pretraining program on it needs (the GPT model, the optimizer, DDP, the pipeline
  schedules, the GPT datasets) and exits;
- ``flow``: ``torchrun --nproc_per_node 1 scripts/pretrain_gpt.py`` training a tiny model one iteration on
  mock data (no evaluation, no save) and exiting; its start-up line (patches/startup_clock.py, on
  megatron.training's start-up timestamps: imports, setup, initialize, model and data, first iteration) is
  collected too.

Both are wall clock from before the launcher starts to its exit, so the flow's figure is its start-up plus
its teardown. ``--baseline REV`` adds a third kind, ``flow@REV``: the same command from a worktree of an earlier
revision (bench/baseline.py), in the same rounds, so a change to the flow's start-up is measured side by side.
``--cold`` gives every flow run a new, empty torch.compile cache (TORCHINDUCTOR_CACHE_DIR): what the first
launch on a machine pays; without it the cache of earlier launches is used, as a second launch would.

Usage: python bench/startup.py [--device cpu|cuda] [--rounds 3] [--model qwen2.5-tiny] [--cold] [--markdown]
       [--baseline REV]
Exits 0 whatever the ratio (a benchmark, not a test); 1 when a run fails.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import baseline  # noqa: E402 - bench/ is not a package

IMPORTS = ("import torch\nimport megatron.core.models.gpt, megatron.core.optimizer, megatron.core.distributed\n"
           "import megatron.core.pipeline_parallel, megatron.core.datasets.gpt_dataset\n")
PHASES = re.compile(r"time from launch to the end of the first iteration: ([0-9.]+) s \((.*)\)")


def _torchrun(args: list[str], env: dict, root: Path = ROOT) -> tuple[float, str]:
    """(wall seconds, output) of a one-rank torchrun of ``args`` in ``root``, whose packages it imports first."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                           *args], cwd=root, env={**env, "PYTHONPATH": baseline.pythonpath(root, env)},
                          capture_output=True, text=True, timeout=900)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args[:2])} failed ({done.returncode}):\n"
                         f"{done.stdout[-2000:]}{done.stderr[-3000:]}")
    return seconds, done.stdout


def flow_argv(model: str, device: str) -> list[str]:
    """The flow's command: a NullTokenizer vocabulary within the tiny models' 512 embedding rows (a larger
    one is refused in one line), on every release and in the earlier flow a baseline runs."""
    precision = ["--bf16"] if device == "cuda" else []
    return ["scripts/pretrain_gpt.py", "--model", model, "--micro-batch-size", "2", "--global-batch-size", "2",
            "--seq-length", "64", "--train-iters", "1", "--lr", "1e-3", "--mock-data", "--eval-iters", "0",
            "--eval-interval", "1000", "--log-interval", "1", "--tokenizer-type", "NullTokenizer", "--vocab-size",
            "500", *precision]


def measure(args) -> dict:
    """Wall seconds of each kind's runs, the flow's start-up lines and its own launch-to-first-iteration
    seconds (this tree's flow only)."""
    env = {**os.environ, "ADAPTER_BACKEND": args.device, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    kinds = ["imports", "flow"] + ([f"flow@{args.baseline}"] if args.baseline else [])
    times = {kind: [] for kind in kinds}
    phases: list[str] = []
    first: list[float] = []
    with tempfile.TemporaryDirectory(prefix="startup-") as tmp, contextlib.ExitStack() as stack:
        roots = {args.baseline: stack.enter_context(baseline.worktree(args.baseline))} if args.baseline else {}
        script = Path(tmp) / "imports_only.py"
        script.write_text(IMPORTS)
        for round_ in range(args.rounds):
            for kind in (kinds if round_ % 2 == 0 else kinds[::-1]):
                if kind == "imports":
                    times[kind].append(_torchrun([str(script)], env)[0])
                    continue
                flow_env = {**env, "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(dir=tmp)} if args.cold else env
                root = roots.get(kind.partition("@")[2], ROOT)
                seconds, out = _torchrun(flow_argv(args.model, args.device), flow_env, root)
                times[kind].append(seconds)
                if kind == "flow":
                    found = PHASES.search(out)
                    phases.append(found.group(2) if found else "(no start-up line)")
                    first += [float(found.group(1))] if found else []
    return {"times": times, "phases": phases, "first_iteration": first}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default="qwen2.5-tiny")
    parser.add_argument("--cold", action="store_true", help="an empty torch.compile cache for every flow run")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--baseline", metavar="REV", help="also run the flow from this git revision")
    parser.add_argument("--json", help="a file for the medians and the flow's own launch-to-first-iteration "
                                       "seconds (bench/gpu_goals.py)")
    args = parser.parse_args()
    result = measure(args)
    imports, flow = (statistics.median(result["times"][k]) for k in ("imports", "flow"))
    if args.json:
        Path(args.json).write_text(json.dumps({"device": args.device, "cold": args.cold, "imports": imports,
                                               "flow": flow, "first_iteration": result["first_iteration"]}, indent=1))
    load = os.getloadavg()[0]
    cache = "cold" if args.cold else "warm"
    for phases in result["phases"]:
        print(f"flow phases: {phases}")
    if args.markdown:
        print("| device | compile cache | imports only (s) | flow to first iteration (s) | ratio | load |")
        print("| --- | --- | --- | --- | --- | --- |")
        print(f"| {args.device} | {cache} | {imports:.1f} | {flow:.1f} | {flow / imports:.2f}x | {load:.1f} |")
    else:
        print(f"{args.device}, {cache} compile cache, median of {args.rounds}: imports only {imports:.1f} s, "
              f"flow to its first iteration {flow:.1f} s: {flow / imports:.2f}x (load average {load:.1f})")
    if args.baseline:
        base = result["times"][f"flow@{args.baseline}"]
        print(f"flow@{args.baseline}: median {statistics.median(base):.1f} s, all rounds "
              f"{', '.join(f'{t:.1f}' for t in base)}; this tree's flow: all rounds "
              f"{', '.join(f'{t:.1f}' for t in result['times']['flow'])}; this tree / {args.baseline}: medians "
              f"{flow / statistics.median(base):.3f}, best {min(result['times']['flow']) / min(base):.3f} "
              "(below 1: faster now)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

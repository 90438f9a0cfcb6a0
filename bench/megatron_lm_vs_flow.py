"""Iteration time of Megatron-LM's own pretrain_gpt.py (through ``python -m adapter.run``) against our flow
(scripts/pretrain_gpt.py, adapter.training.pretrain), on the CPU, in one run.

Both train the same model on the same ranks (torchrun, 2 processes, TP2, gloo), float32, --mock-data,
the same batch and no DataLoader workers, dropout 0; each logs every iteration in Megatron-LM's format
and the per-iteration times after ``--warmup`` iterations are read off that log. Both run the same
megatron-core with the same adapter patches and kernel provider, so the difference is the training loop
around the model. The flow runs without the Megatron-LM checkout on its PYTHONPATH (its megatron.core
is the installed one, as adapter.run makes Megatron-LM's). Shapes: ``small`` (default; 4 layers, hidden
256, seq 256: compute matters) or ``tiny`` (the megatron_lm tests' model: mostly per-iteration overhead).

Usage: python bench/megatron_lm_vs_flow.py [--megatron-lm PATH] [--shape small|tiny] [--iters 10] [--warmup 3]
PATH defaults to the Megatron-LM checkout on PYTHONPATH (tag core_v0.16.1; needs ``six``).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from adapter.core_source import megatron_lm_checkout  # noqa: E402 - after the repository is importable

NPROC = 2
SHAPES = {
    "small": dict(layers=4, hidden=256, ffn=704, heads=8, groups=4, seq=256, vocab=4095, micro=4, batch=8),
    "tiny": dict(layers=2, hidden=64, ffn=128, heads=4, groups=2, seq=64, vocab=999, micro=2, batch=8),
}
ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([\d.]+)")


def model_args(shape: dict, iters: int) -> list[str]:
    """The arguments both scripts take alike (Megatron-LM's spelling; the flow accepts it)."""
    args = ["--num-layers", str(shape["layers"]), "--hidden-size", str(shape["hidden"]),
            "--num-attention-heads", str(shape["heads"]), "--group-query-attention",
            "--num-query-groups", str(shape["groups"]), "--seq-length", str(shape["seq"]),
            "--max-position-embeddings", str(shape["seq"]), "--normalization", "RMSNorm", "--swiglu",
            "--position-embedding-type", "rope", "--add-qkv-bias", "--disable-bias-linear",
            "--transformer-impl", "local", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(shape["vocab"]),
            "--micro-batch-size", str(shape["micro"]), "--global-batch-size", str(shape["batch"]),
            "--tensor-model-parallel-size", str(NPROC), "--mock-data", "--num-workers", "0",
            "--train-iters", str(iters), "--lr", "1e-4", "--lr-decay-style", "constant",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1",
            "--eval-iters", "0", "--eval-interval", str(iters), "--seed", "1234",
            "--ffn-hidden-size", str(shape["ffn"])]
    return args


def find_megatron_lm(given: str | None) -> Path:
    """The checkout, or SystemExit saying what is missing."""
    checkout = megatron_lm_checkout() if given is None else Path(given).resolve()
    if checkout is None:
        raise SystemExit("no Megatron-LM: pass --megatron-lm PATH, or put a Megatron-LM checkout at tag "
                         "core_v0.16.1 on PYTHONPATH")
    missing = [p for p in ("pretrain_gpt.py", "megatron/training/__init__.py") if not (checkout / p).is_file()]
    if missing:
        raise SystemExit(f"{checkout} is not a Megatron-LM checkout: no {', '.join(missing)}")
    if importlib.util.find_spec("six") is None:
        raise SystemExit("Megatron-LM's tokenizers import six, which is not installed: pip install six")
    return checkout


def run(name: str, command: list[str], pythonpath: list[str], workdir: Path, warmup: int) -> list[float]:
    """Per-iteration milliseconds after ``warmup`` from one torchrun of ``command``."""
    env = {**os.environ, "ADAPTER_BACKEND": "cpu", "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // NPROC)),
           "PYTHONPATH": os.pathsep.join(pythonpath)}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(NPROC), *command], cwd=workdir, env=env, capture_output=True, text=True)
    times = {int(i): float(ms) for i, ms in ITERATION.findall(done.stdout)}
    if done.returncode != 0 or not times:
        raise SystemExit(f"{name} failed (exit status {done.returncode}):\n{done.stdout[-3000:]}\n"
                         f"{done.stderr[-3000:]}")
    return [ms for i, ms in sorted(times.items()) if i > warmup]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megatron-lm", help="Megatron-LM checkout (default: the one on PYTHONPATH)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--iters", type=int, default=10, help="measured iterations")
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)
    checkout = find_megatron_lm(args.megatron_lm)
    common = model_args(SHAPES[args.shape], args.warmup + args.iters)
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != checkout]
    with tempfile.TemporaryDirectory(prefix="megatron-lm-vs-flow-") as workdir:
        megatron_lm = run("Megatron-LM pretrain_gpt.py", ["-m", "adapter.run", str(checkout / "pretrain_gpt.py"),
                                                          *common], [str(ROOT), str(checkout), *inherited],
                          Path(workdir), args.warmup)
        flow = run("scripts/pretrain_gpt.py", [str(ROOT / "scripts" / "pretrain_gpt.py"), *common],
                   [str(ROOT), *inherited], Path(workdir), args.warmup)
    import torch

    print(f"iteration time on CPU, {NPROC} ranks TP{NPROC} (gloo), float32, --mock-data, shape {args.shape} "
          f"{SHAPES[args.shape]}; {args.warmup} warm-up + {args.iters} measured iterations, one run each; "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs")
    print(f"{'run':<44} {'median ms':>10} {'mean ms':>9}   per iteration (ms)")
    for name, times in (("Megatron-LM pretrain_gpt.py (adapter.run)", megatron_lm),
                        ("our flow (scripts/pretrain_gpt.py)", flow)):
        print(f"{name:<44} {statistics.median(times):10.1f} {statistics.fmean(times):9.1f}   "
              f"{', '.join(f'{t:.0f}' for t in times)}")
    print(f"ratio Megatron-LM / our flow: {statistics.median(megatron_lm) / statistics.median(flow):.3f} (medians), "
          f"{statistics.fmean(megatron_lm) / statistics.fmean(flow):.3f} (means); above 1: Megatron-LM's loop is "
          "slower")


if __name__ == "__main__":
    main()

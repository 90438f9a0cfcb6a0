"""The feature matrix: each feature of Megatron-LM's recipes, tiny, through the one flow (scripts/pretrain_gpt.py,
megatron.training's own ``pretrain``), on the cpu backend and with the npu kernel provider against the
project's torch_npu double: a column per backend; writes docs/FEATURES.md.

Each cell is one torchrun of a tiny model (4 layers, hidden 64, 4 iterations, --mock-data) with the feature's
flags, Megatron-LM's spelling, and ends as one of:

- ``trains``: exit status 0 and a finite loss logged at the last iteration;
- ``refused``: a non-zero exit with no traceback from a worker: the line that says why is shown (and how
  many times the job printed it: one line per job is the goal);
- ``fails``: anything else (a worker's traceback, no loss, a time-out); the matrix's goal is to have none.

With a Megatron-LM checkout (``--megatron-lm PATH``, default the one on PYTHONPATH; its tag must be the
installed megatron-core's), each cell also runs Megatron-LM's own pretrain_gpt.py under ``python -m
adapter.run`` with the same flags, and says whether it ends the same (the same last loss, or the same
refusal); without one, the note says the comparison was not made.

Usage: python bench/feature_matrix.py [--megatron-lm PATH] [--backends cpu,npu] [--only NAME ...]
       [--out docs/FEATURES.md] [--jobs 1] [--update]
Every cell's outcome is also kept in docs/FEATURES.json; ``--update`` reruns only the cells asked for and keeps
the others from there (a whole matrix is 72 torchruns, twice that with the comparison: a change to one feature
reruns its row).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from adapter.core_source import megatron_lm_checkout  # noqa: E402 - after the repository is importable

ITERS = 4
BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
        "--seq-length", "64", "--max-position-embeddings", "64",
        "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope", "--disable-bias-linear",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "255", "--mock-data", "--num-workers", "0",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(ITERS), "--lr", "1e-3",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1", "--eval-iters", "0",
        "--eval-interval", "1000", "--seed", "1234"]
LOCAL = ["--transformer-impl", "local"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "64", "--moe-aux-loss-coeff", "1e-2"]
DSV3_ROUTER = ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
               "--moe-router-num-groups", "2", "--moe-router-group-topk", "1", "--moe-router-topk-scaling-factor",
               "2.5", "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-shared-expert-intermediate-size",
               "64", "--moe-router-dtype", "fp32"]
MLA = ["--multi-latent-attention", "--q-lora-rank", "32", "--kv-lora-rank", "16", "--qk-head-dim", "16",
       "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16"]
SAVE = "{workdir}/checkpoints"


@dataclasses.dataclass(frozen=True)
class Feature:
    name: str
    flags: tuple[str, ...]
    nproc: int = 2
    local: bool = True  # add --transformer-impl local (False: the feature is the impl itself)
    env: tuple[tuple[str, str], ...] = ()  # the cell's environment on top of the backend's


def _f(name: str, flags: list[str], nproc: int = 2, local: bool = True, env: dict | None = None) -> Feature:
    return Feature(name, tuple(flags), nproc, local, tuple((env or {}).items()))


FEATURES = (
    _f("TP2", ["--tensor-model-parallel-size", "2"]),
    _f("TP2 SP, distributed optimizer, overlapped grad reduce and param gather",
       ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--use-distributed-optimizer",
        "--overlap-grad-reduce", "--overlap-param-gather"], nproc=4),
    _f("PP2 with VPP", ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]),
    _f("uneven PP (first stage's layers)", ["--pipeline-model-parallel-size", "2",
                                             "--decoder-first-pipeline-num-layers", "1"]),
    _f("uneven PP (embedding and loss counted)", ["--pipeline-model-parallel-size", "2",
                                                  "--account-for-embedding-in-pipeline-split",
                                                  "--account-for-loss-in-pipeline-split"]),
    _f("CP2 p2p", ["--context-parallel-size", "2", "--cp-comm-type", "p2p"]),
    _f("CP2 a2a", ["--context-parallel-size", "2", "--cp-comm-type", "a2a"]),
    _f("full recompute", ["--recompute-granularity", "full", "--recompute-method", "uniform",
                          "--recompute-num-layers", "1"]),
    _f("selective recompute (core_attn mlp layernorm)",
       ["--recompute-granularity", "selective", "--recompute-modules", "core_attn", "mlp", "layernorm"]),
    _f("bf16", ["--bf16"]),
    _f("fp16 with loss scaling", ["--fp16", "--initial-loss-scale", "1024"]),
    _f("per-token loss", ["--calculate-per-token-loss"]),
    _f("QK layernorm", ["--qk-layernorm"]),
    _f("SGD", ["--optimizer", "sgd"]),
    _f("manual GC", ["--manual-gc"]),
    # megatron.training saves asynchronously only through its persistent worker (without it validate_args
    # turns --async-save off); mcore: megatron-core's own writer (the default, nvrx, is nvidia-resiliency-ext's)
    _f("async torch_dist save", ["--save", SAVE, "--save-interval", "2", "--async-save", "--ckpt-format",
                                 "torch_dist", "--use-persistent-ckpt-worker", "--async-strategy", "mcore"]),
    _f("fully parallel save and load", ["--save", SAVE, "--save-interval", "2", "--ckpt-fully-parallel-save",
                                        "--ckpt-fully-parallel-load"]),
    _f("Transformer Engine impl (Megatron-LM's default)", ["--transformer-impl", "transformer_engine"],
       local=False),
    _f("MoE TP2 SP allgather", [*MOE, "--tensor-model-parallel-size", "2", "--sequence-parallel",
                                "--moe-token-dispatcher-type", "allgather"]),
    _f("MoE TP2 ETP1 EP2 alltoall", [*MOE, "--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size",
                                     "1", "--expert-model-parallel-size", "2", "--sequence-parallel",
                                     "--moe-token-dispatcher-type", "alltoall"], nproc=4),
    _f("MoE capacity factor with padding", [*MOE, "--moe-expert-capacity-factor", "1.0",
                                            "--moe-pad-expert-input-to-capacity"]),
    _f("MoE grouped GEMM (Mixtral recipe)", [*MOE, "--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall",
                                             "--expert-model-parallel-size", "2"]),
    _f("DeepSeek-V3 router", [*MOE, *DSV3_ROUTER]),
    _f("multi-token prediction", ["--mtp-num-layers", "1"]),
    _f("multi-latent attention", MLA),
    _f("multi-latent attention without q-LoRA", [f for f in MLA if f not in ("--q-lora-rank", "32")]),
    _f("multi-latent attention, CP2 a2a", [*MLA, "--context-parallel-size", "2", "--cp-comm-type", "a2a"]),
    _f("multi-latent attention, CP2 p2p", [*MLA, "--context-parallel-size", "2", "--cp-comm-type", "p2p"]),
    _f("DeepSeek-V3 (MLA, MTP, its router) PP2 EP2",
       [*MLA, *MOE, *DSV3_ROUTER, "--mtp-num-layers", "1", "--moe-layer-freq", "([0]*1+[1]*3)",
        "--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2"], nproc=4),
    _f("Megatron-FSDP", ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
                         "--use-distributed-optimizer", "--ckpt-format", "fsdp_dtensor"]),
    _f("Megatron-FSDP, fsdp_dtensor save", ["--use-megatron-fsdp", "--data-parallel-sharding-strategy",
                                            "optim_grads_params", "--use-distributed-optimizer", "--ckpt-format",
                                            "fsdp_dtensor", "--save", SAVE, "--save-interval", "2"]),
    _f("torch FSDP2", ["--use-torch-fsdp2", "--untie-embeddings-and-output-weights"]),  # validate_args asks it
    _f("optimizer CPU offload", ["--use-distributed-optimizer", "--optimizer-cpu-offload",
                                 "--use-precision-aware-optimizer", "--optimizer-offload-fraction", "1.0"]),
    # the NPU path of megatron's HybridDeviceOptimizer, its "device" tensors told from host copies by
    # adapter/host_memory.py's stand-in: what an NPU runs, before one does
    _f("optimizer CPU offload, fraction 0.5, host stand-in",
       ["--use-distributed-optimizer", "--optimizer-cpu-offload", "--use-precision-aware-optimizer",
        "--optimizer-offload-fraction", "0.5", "--bf16"], env={"ADAPTER_HOST_STAND_IN": "1"}),
    _f("fine-grained activation offloading", ["--fine-grained-activation-offloading", "--offload-modules", "core_attn",
                                              "attn_proj", "--min-offloaded-tensor-size", "0"]),
    _f("FP8", ["--fp8-format", "hybrid"]),
    _f("TP communication overlap", ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                    "--tp-comm-overlap"]),
    _f("flex dispatcher (DeepEP)", [*MOE, "--moe-token-dispatcher-type", "flex"]),
    _f("CUDA graphs", ["--cuda-graph-impl", "local"]),
    _f("NCCL user buffers", ["--use-nccl-ub"]),
    _f("symmetric-memory all-reduce", ["--symmetric-ar-type", "two_shot"]),
)
BACKENDS = {"cpu": {"ADAPTER_BACKEND": "cpu"},
            "npu": {"ADAPTER_BACKEND": "cpu", "ADAPTER_KERNELS": "npu"}}  # and the double on PYTHONPATH
DOUBLES = ROOT / "tests" / "doubles"
TRAIN_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: (\S+) \|")
TRACEBACK = "Traceback (most recent call last)"
REFUSAL = re.compile(r"(?i)\berror\b|refused|runs only on")
USAGE = re.compile(r"\s*(usage:|\[-)")  # argparse's usage text, not the reason


@dataclasses.dataclass
class Outcome:
    verdict: str  # trains | refused | fails
    detail: str  # the last loss, the refusal line, or what failed
    seconds: float = 0.0
    log: str = dataclasses.field(default="", repr=False)


def classify(returncode: int | None, log: str) -> Outcome:
    """What a cell's log says (``returncode`` None: it timed out). torchrun's own report of failed workers
    (a ChildFailedError traceback) is torchrun's, not a worker's, and does not count as one."""
    if returncode is None:
        return Outcome("fails", "timed out")
    losses = {int(i): loss for i, loss in TRAIN_LINE.findall(log)}
    if returncode == 0:
        last = losses.get(max(losses, default=-1))
        if last is not None and _finite(last):
            return Outcome("trains", f"loss {last} at iteration {max(losses)}")
        return Outcome("fails", f"exit status 0 without a finite loss (last: {last})")
    worker_tracebacks = log.count(TRACEBACK) - ("ChildFailedError" in log)
    lines = [line.strip() for line in log.splitlines() if REFUSAL.search(line) and not _torchrun_report(line)
             and not USAGE.match(line)]
    lines.sort(key=lambda line: "error: " not in line)  # a program's own "error: ..." line first
    if worker_tracebacks > 0:
        return Outcome("fails", _last_error(log) or f"exit status {returncode}")
    if not lines:
        return Outcome("fails", f"exit status {returncode}, no line says why")
    said = _strip_rank(lines[0])
    times = sum(_strip_rank(line) == said for line in lines)
    return Outcome("refused", said + (f" (printed {times} times)" if times > 1 else ""))


def _finite(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def _torchrun_report(line: str) -> bool:
    return any(word in line for word in ("ChildFailedError", "error_file", "elastic", "errors.html",
                                         "To enable traceback"))


def _strip_rank(line: str) -> str:
    return re.sub(r"^\[(default)?rank\d+\]:\s*", "", line)


def _last_error(log: str) -> str | None:
    errors = [_strip_rank(line.strip()) for line in log.splitlines()
              if re.search(r"^\s*(\[rank\d+\]:\s*)?\w+(\.\w+)*(Error|Exception)\b", line)
              and not _torchrun_report(line)]
    return errors[-1] if errors else None


def command(feature: Feature, checkout: Path | None, workdir: Path) -> list[str]:
    """The cell's torchrun: scripts/pretrain_gpt.py, or Megatron-LM's own script where ``checkout`` is given."""
    script = (["-m", "adapter.run", str(checkout / "pretrain_gpt.py")] if checkout
              else [str(ROOT / "scripts" / "pretrain_gpt.py")])
    flags = [flag.format(workdir=workdir) for flag in feature.flags]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(feature.nproc),
            *script, *BASE, *(LOCAL if feature.local else []), *flags]


def run_cell(feature: Feature, backend: str, checkout: Path | None, timeout: int) -> Outcome:
    """The cell: one torchrun of scripts/pretrain_gpt.py in a scratch directory; with ``checkout``, one of
    Megatron-LM's pretrain_gpt.py too, whose outcome the detail compares."""
    outcome = _run(feature, backend, None, timeout)
    if checkout is not None:
        theirs = _run(feature, backend, checkout, timeout)
        same = (theirs.verdict, theirs.detail) == (outcome.verdict, outcome.detail)
        outcome.detail += ("; Megatron-LM's pretrain_gpt.py: the same" if same
                           else f"; Megatron-LM's pretrain_gpt.py: {theirs.verdict}, {theirs.detail}")
        outcome.seconds += theirs.seconds
    return outcome


def _run(feature: Feature, backend: str, checkout: Path | None, timeout: int) -> Outcome:
    pythonpath = [str(ROOT), *([str(checkout)] if checkout else [])]
    if backend == "npu":
        pythonpath.insert(0, str(DOUBLES))
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                 if p and (checkout is None or Path(p).resolve() != checkout)]
    env = {**os.environ, **BACKENDS[backend], **dict(feature.env), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([*pythonpath, *inherited])}
    with tempfile.TemporaryDirectory(prefix="feature-matrix-") as workdir:
        started = time.monotonic()
        try:
            done = subprocess.run(command(feature, checkout, Path(workdir)), cwd=workdir, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
            outcome = classify(done.returncode, done.stdout)
            outcome.log = done.stdout
        except subprocess.TimeoutExpired:
            outcome = classify(None, "")
    outcome.seconds = time.monotonic() - started
    return outcome


def _flags_text(feature: Feature) -> str:
    return " ".join([*(f"{k}={v}" for k, v in feature.env), *(f for f in feature.flags if f != SAVE)]) or "(none)"


def markdown(results: dict, backends: list[str], note: str) -> str:
    """docs/FEATURES.md: a row per feature, a column per backend."""
    head = " | ".join("npu provider (double)" if b == "npu" else "cpu" for b in backends)
    rows = [f"| feature | flags | ranks | {head} |", "|" + " --- |" * (3 + len(backends))]
    for feature in FEATURES:
        cells = [results.get((feature.name, backend)) for backend in backends]
        if all(cell is None for cell in cells):
            continue
        text = [f"**{c.verdict}**: {c.detail}".replace("|", "\\|") if c else "not run" for c in cells]
        rows.append(f"| {feature.name} | `{_flags_text(feature)}` | {feature.nproc} | {' | '.join(text)} |")
    counts = {v: sum(c.verdict == v for c in results.values()) for v in ("trains", "refused", "fails")}
    return "\n".join([
        "# Features of Megatron-LM's recipes, by backend",
        "",
        "Written by `python bench/feature_matrix.py` (do not edit by hand). Each cell is one torchrun of",
        f"`scripts/pretrain_gpt.py` (megatron.training's `pretrain`) on a tiny model (4 layers, hidden 64, {ITERS}",
        "iterations, `--mock-data`) with the feature's flags; `trains` ends with a finite loss, `refused` stops",
        "before training with the line shown, `fails` is anything else. Where a Megatron-LM checkout was at",
        "hand, each cell also says how Megatron-LM's own `pretrain_gpt.py` (under `python -m adapter.run`) ended.",
        "",
        note,
        "",
        f"Totals: {counts['trains']} trains, {counts['refused']} refused, {counts['fails']} fails.",
        "",
        *rows,
        "",
    ])


def load_results(path: Path) -> dict:
    """The cells recorded in ``path`` (docs/FEATURES.json), keyed (feature, backend); none if absent."""
    if not path.exists():
        return {}
    return {tuple(cell["key"]): Outcome(cell["verdict"], cell["detail"], cell["seconds"])
            for cell in json.loads(path.read_text())["cells"]}


def save_results(path: Path, results: dict, note: str) -> None:
    cells = [{"key": list(key), "verdict": o.verdict, "detail": o.detail, "seconds": round(o.seconds, 1)}
             for key, o in sorted(results.items())]
    lines = ",\n  ".join(json.dumps(cell) for cell in cells)  # a cell a line: a rerun row is a small diff
    path.write_text(f'{{"note": {json.dumps(note)},\n "cells": [\n  {lines}\n ]}}\n')


def _columns(results: dict) -> list[str]:
    """The backends that have a cell, in the matrix's order."""
    return [b for b in BACKENDS if any(k[1] == b for k in results)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megatron-lm", help="Megatron-LM checkout to compare with (default: the one on PYTHONPATH)")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--only", nargs="+", help="features whose name contains any of these")
    parser.add_argument("--out", default=str(ROOT / "docs" / "FEATURES.md"))
    parser.add_argument("--jobs", type=int, default=1, help="cells run at once")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    parser.add_argument("--update", action="store_true", help="keep the other cells recorded in the JSON")
    args = parser.parse_args(argv)
    backends = args.backends.split(",")
    checkout = Path(args.megatron_lm).resolve() if args.megatron_lm else megatron_lm_checkout()
    note = _environment_note(checkout)
    if checkout is None:
        note += " No Megatron-LM checkout was at hand: its pretrain_gpt.py was not compared."
    features = [f for f in FEATURES if not args.only or any(word in f.name for word in args.only)]
    cells = [(f, b) for f in features for b in backends]
    recorded = Path(args.out).with_suffix(".json")
    results = load_results(recorded) if args.update else {}
    if args.update:
        note += " Cells not rerun are kept from docs/FEATURES.json, as an earlier run recorded them."
    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        futures = {pool.submit(run_cell, f, b, checkout, args.timeout): (f.name, b) for f, b in cells}
        for future in concurrent.futures.as_completed(futures):
            key, outcome = futures[future], future.result()
            results[key] = outcome
            print(f"{' / '.join(key)}: {outcome.verdict} ({outcome.seconds:.0f} s): {outcome.detail}", flush=True)
            Path(args.out).write_text(markdown(results, _columns(results), note))  # as far as it got
            save_results(recorded, results, note)
    print(f"wrote {args.out}")
    return 1 if any(o.verdict == "fails" for o in results.values()) else 0


def _environment_note(checkout: Path | None) -> str:
    import importlib.metadata

    import torch

    where = (f"Megatron-LM checkout {checkout.name}{_checkout_release(checkout)}" if checkout
             else "no Megatron-LM checkout")
    return (f"Measured with torch {torch.__version__}, megatron-core {importlib.metadata.version('megatron-core')}, "
            f"{where}, Python {sys.version.split()[0]}, on {os.cpu_count()} CPUs.")


def _checkout_release(checkout: Path) -> str:
    """The release a checkout's megatron/core/package_info.py names (an archive has no git tag to ask)."""
    numbers = dict(re.findall(r"^(MAJOR|MINOR|PATCH) = (\d+)$", (checkout / "megatron" / "core" / "package_info.py")
                              .read_text(errors="replace"), re.M)) if (checkout / "megatron").is_dir() else {}
    return f" (megatron-core {numbers['MAJOR']}.{numbers['MINOR']}.{numbers['PATCH']})" if len(numbers) == 3 else ""


if __name__ == "__main__":
    sys.exit(main())

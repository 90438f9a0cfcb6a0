"""The pretrain flow against Hugging Face transformers on one device, bf16 mixed precision on both sides.

Per named model (models/, random weights, nothing downloaded), the same shape, micro-batch and sequence
length, each side in a fresh interpreter (one process, one rank: its memory peak is its own):

- ``flow``: scripts/pretrain_gpt.py's flow (megatron.training's own ``pretrain``, ``flow.pretrain``) with
  --mock-data, ``--bf16 --use-distributed-optimizer`` (bf16 parameters, fp32 main parameters and gradients),
  the flow's defaults for the device otherwise;
- ``transformers``: ``AutoModelForCausalLM`` from the same config (``models.hf.config_to_hf``), trained as
  HF Trainer's ``bf16=True`` runs it: fp32 parameters under ``torch.autocast(<device>, torch.bfloat16)``,
  SDPA attention, fused ``torch.optim.AdamW``, gradients clipped to norm 1.0.

Both are timed the same way, each step between device synchronisations, over ``--steps`` after
``--warmup``. Model FLOPs per token are ``flow.model_flops.model_flops_per_token``'s: 6 x matmul parameters
(output layer included) + 12 x layers x seq x attention width, the full s x s score matrix, not halved for
causal masking. The device's bf16 matmul peak is a timed ``--peak-size``^3 bf16 ``torch.mm`` (8192 on CUDA).
Peak memory: ``torch.cuda.max_memory_allocated`` on CUDA, the process's max RSS on the CPU.

``--variants`` runs the flow once more per comma-separated set of these besides its default: leads turned off,
``fused-adam`` (ADAPTER_FUSED_ADAM=0), ``ce-fusion`` (without --cross-entropy-loss-fusion), ``grad-accum-fusion``
(--no-gradient-accumulation-fusion), ``sdpa-views`` (ADAPTER_SDPA_CONTIGUOUS=1); each RMSNorm/RoPE/SwiGLU choice,
``fused=eager``, ``fused=compile``, ``fused=liger`` (ADAPTER_CUDA_FUSED; the default row is the automatic one);
``no-distopt``, without --use-distributed-optimizer (the regime of the 2026-11-26 GPU run); and
``one-rank-groups=all`` (ADAPTER_ONE_RANK_GROUPS=all: megatron's one-rank NCCL groups answered on the calling thread).
Goals: flow / transformers >= 1.15; >= 50% of the bf16 matmul peak at 1.5B/1.7B; flow memory <= transformers'.

A run that fails is a row with its error, and with ``--profile`` its table still comes: the profiler runs
from the first step (its warm-up record is dropped when the measured steps begin), so a failing step is in
it, with the traceback. ``--json PATH`` writes the rows for bench/gpu_goals.py.

Usage: python bench/gpu_train.py --device cuda [--models qwen2.5-0.5b qwen2.5-1.5b] [--steps 10] [--warmup 3]
       [--profile DIR] [--markdown] [--variants fused-adam ce-fusion,grad-accum-fusion fused=eager] [--json F]
       python bench/gpu_train.py --tiny      # the CPU check, under 2 minutes
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPES = {"qwen2.5-0.5b": (2048, 4), "qwen2.5-1.5b": (4096, 2), "qwen3-1.7b": (4096, 2), "qwen2.5-tiny": (64, 2),
          "qwen3.5-tiny": (256, 2), "qwen3.5-bench": (4096, 1)}
# variant -> (environment, flow arguments added, flow arguments left out)
VARIANTS = {"fused-adam": ({"ADAPTER_FUSED_ADAM": "0"}, [], []),
            "ce-fusion": ({}, [], ["--cross-entropy-loss-fusion"]),
            "grad-accum-fusion": ({}, ["--no-gradient-accumulation-fusion"], []),
            "sdpa-views": ({"ADAPTER_SDPA_CONTIGUOUS": "1"}, [], []),
            **{f"fused={choice}": ({"ADAPTER_CUDA_FUSED": choice}, [], []) for choice in ("eager", "compile", "liger")},
            "no-distopt": ({}, [], ["--use-distributed-optimizer"]),
            "one-rank-groups=all": ({"ADAPTER_ONE_RANK_GROUPS": "all"}, [], [])}


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _peak_memory(device: str) -> int:
    """Bytes: the allocator's peak on CUDA, the process's max RSS on the CPU (kilobytes on Linux)."""
    import torch

    if device == "cuda":
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class StepClock:
    """Times each training step between device syncs. With ``profile`` (a table's file) torch.profiler runs
    from the first step, its record started afresh when the measured steps begin: the table holds the
    measured steps, or, when a step fails, everything up to and including the failing one."""

    def __init__(self, device: str, warmup: int, profile: str | None):
        self.device, self.warmup, self.profile = device, warmup, profile
        self.seconds, self.count, self.profiler = [], 0, None
        self.op_counts = {}  # op name -> calls in the profiler's record (bench/moe.py's host work)

    def __call__(self, step):
        def timed(*args, **kwargs):
            if self.profile and self.count in (0, self.warmup):
                self._start_profiler()
            _sync(self.device)
            start = time.perf_counter()
            result = step(*args, **kwargs)
            _sync(self.device)
            if self.count >= self.warmup:
                self.seconds.append(time.perf_counter() - start)
            self.count += 1
            return result

        return timed

    def _start_profiler(self) -> None:
        if self.profiler is not None:  # the warm-up's record, dropped
            self.profiler.__exit__(None, None, None)
        self.profiler = _profiler(self.device)
        self.profiler.__enter__()

    def around(self, run):
        """``run()``, the profile written whatever happens (a failure's traceback above its table)."""
        try:
            result = run()
        except BaseException:
            self.finish(traceback.format_exc())
            raise
        self.finish()
        return result

    def finish(self, failure: str | None = None) -> None:
        if self.profiler is None:
            if failure and self.profile:
                Path(self.profile).write_text(f"FAILED before its first step:\n{failure}")
            return
        self.profiler.__exit__(None, None, None)
        averages = self.profiler.key_averages()
        self.op_counts = {event.key: event.count for event in averages}
        sorts = (["cuda_time_total"] if self.device == "cuda" else []) + ["cpu_time_total"]
        tables = [f"sorted by {sort_by}:\n" + averages.table(sort_by=sort_by, row_limit=30) for sort_by in sorts]
        steps = f"steps 1-{self.count}, the last one failing" if failure else f"{len(self.seconds)} measured steps"
        head = f"FAILED in step {self.count + 1}:\n{failure}\n" if failure else ""
        Path(self.profile).write_text(f"{head}profile of {steps}\n\n" + "\n\n".join(tables))


def _profiler(device: str):
    import torch

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=activities)


def _flow_argv(name: str, steps: int, warmup: int, extra: list[str], dropped: list[str] = ()) -> list[str]:
    seq, micro = SHAPES[name]
    argv = ["--model", name, "--seq-length", str(seq), "--micro-batch-size", str(micro),
            "--global-batch-size", str(micro), "--train-iters", str(warmup + steps), "--lr", "1e-4",
            "--lr-decay-style", "constant", "--mock-data", "--log-interval", "1",
            "--eval-interval", "1000000", "--eval-iters", "0",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--bf16", "--use-distributed-optimizer",
            "--cross-entropy-loss-fusion", *extra]
    return [arg for arg in argv if arg not in dropped]


def timed_flow(argv: list[str], clock: StepClock) -> None:
    """scripts/pretrain_gpt.py's flow (megatron.training's own ``pretrain``) on ``argv``, each of megatron's
    ``train_step`` calls timed by ``clock``: data, forward, backward and the optimizer step, not the log line
    megatron writes between steps."""
    import adapter  # noqa: F401 - before megatron
    from megatron.training import training

    from flow import pretrain

    training.train_step = clock(training.train_step)
    clock.around(lambda: pretrain.run(argv))


def run_flow(name: str, device: str, steps: int, warmup: int, profile: str | None, extra: list[str],
             dropped: list[str] = ()) -> dict:
    """The pretrain flow's steps, timed around megatron.training's ``train_step``."""
    clock = StepClock(device, warmup, profile)
    timed_flow(_flow_argv(name, steps, warmup, extra, dropped), clock)
    from adapter import kernels

    return {"seconds": clock.seconds, "peak_memory": _peak_memory(device),
            "fused": getattr(kernels.current(), "FUSED", None),  # the cuda provider's RMSNorm/RoPE/SwiGLU choice
            "gated_delta": "torch" if kernels.current().chunk_gated_delta_rule else "fla"}


def _hf_model(name: str, device: str):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import models
    from models.hf import config_to_hf

    model = models.get(name)
    hf = config_to_hf(model)
    hf.pop("architectures"), hf.pop("torch_dtype", None)
    config = AutoConfig.for_model(**hf)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", torch_dtype=torch.float32)
    return model.to(device).train()


def run_transformers(name: str, device: str, steps: int, warmup: int, profile: str | None) -> dict:
    """HF Trainer's bf16 step: fp32 parameters under autocast, fused AdamW, clip 1.0."""
    import torch

    model = _hf_model(name, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    seq, micro = SHAPES[name]
    tokens = torch.randint(0, model.config.vocab_size, (micro, seq), device=device)

    def train_step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    clock = StepClock(device, warmup, profile)
    step = clock(train_step)
    clock.around(lambda: [step() for _ in range(warmup + steps)])
    from transformers.utils.import_utils import is_flash_linear_attention_available

    return {"seconds": clock.seconds, "peak_memory": _peak_memory(device),
            "gated_delta": "fla" if is_flash_linear_attention_available() else "torch"}


def matmul_peak(device: str, size: int, repeats: int = 10) -> float:
    """Best bf16 FLOP/s of a square ``torch.mm`` on ``device``."""
    import torch

    a, b = (torch.randn(size, size, device=device, dtype=torch.bfloat16) for _ in range(2))
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        torch.mm(a, b)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size ** 3 / best


def _child(args, kind: str, name: str = "", variant: str = "") -> dict | float:
    """One fresh interpreter for ``kind`` (flow, transformers or peak); ``variant``: comma-separated VARIANTS.
    A run that fails gives ``{"error": the end of its output}``."""
    chosen = [VARIANTS[v] for v in variant.split(",") if v]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "ADAPTER_BACKEND": args.device, **{k: v for env, _, _ in chosen for k, v in env.items()}}
    profile = (str(Path(args.profile) / f"{name}-{kind}{'-' + variant if variant else ''}.txt")
               if args.profile and name else "")
    command = [sys.executable, str(ROOT / "bench" / "gpu_train.py"), "--child", kind, "--device", args.device,
               "--models", name or "none", "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--peak-size", str(args.peak_size), "--profile", profile,
               "--child-extra=" + " ".join(arg for _, extra, _ in chosen for arg in extra),
               "--child-dropped=" + " ".join(arg for _, _, dropped in chosen for arg in dropped)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        error = f"{kind} {name} {variant} failed ({done.returncode}):\n{done.stdout[-1500:]}\n{done.stderr[-3000:]}"
        if kind == "peak":
            raise SystemExit(error)
        return {"error": error}
    return json.loads(lines[-1][len("RESULT "):])


def _run_child(args) -> None:
    name, extra, dropped = args.models[0], args.child_extra.split(), args.child_dropped.split()
    profile = args.profile or None
    if args.child == "peak":
        result = matmul_peak(args.device, args.peak_size)
    elif args.child == "flow":
        result = run_flow(name, args.device, args.steps, args.warmup, profile, extra, dropped)
    else:
        result = run_transformers(name, args.device, args.steps, args.warmup, profile)
    print("RESULT " + json.dumps(result), flush=True)


def _rate(name: str, result: dict) -> float:
    seq, micro = SHAPES[name]
    return micro * seq * len(result["seconds"]) / sum(result["seconds"])


def _row(name: str, side: str, result: dict, base: dict, peak: float) -> dict:
    """One run's figures (bench/gpu_goals.py reads these): tokens/s, against transformers', model FLOP/s,
    its share of the matmul peak, peak memory; or the run's error."""
    import models
    from flow.model_flops import model_flops_per_token

    if "error" in result:
        return {"model": name, "run": side, "error": result["error"]}
    seq, _ = SHAPES[name]
    rate = _rate(name, result)
    flops = rate * model_flops_per_token(models.get(name), seq)
    return {"model": name, "run": side, "fused": result.get("fused"), "gated_delta": result.get("gated_delta"),
            "tokens_per_second": rate,
            "ratio": None if "error" in base else rate / _rate(name, base),
            "tflops": flops / 1e12, "peak_fraction": flops / peak, "peak_gib": result["peak_memory"] / 2**30}


def _cells(row: dict) -> list[str]:
    if "error" in row:
        return [row["model"], row["run"], "failed", "-", "-", "-", "-"]
    ratio = "-" if row["ratio"] is None else f"{row['ratio']:.3f}"
    return [row["model"], row["run"], f"{row['tokens_per_second']:.0f}", ratio, f"{row['tflops']:.3g}",
            f"{100 * row['peak_fraction']:.1f}%", f"{row['peak_gib']:.2f}"]


def _print(rows: list[dict], markdown: bool) -> None:
    header = ["model", "run", "tokens/s", "/ transformers", "model TFLOP/s", "% of bf16 peak", "peak GiB"]
    cells = [_cells(row) for row in rows]
    if markdown:
        print("| " + " | ".join(header) + " |\n|" + " --- |" * len(header))
        for row in cells:
            print("| " + " | ".join(row) + " |")
    else:
        widths = [max(len(r[i]) for r in [header, *cells]) for i in range(len(header))]
        for row in [header, *cells]:
            print("  ".join(cell.rjust(width) for cell, width in zip(row, widths)))
    for row in rows:
        if "error" in row:
            print(f"\n{row['model']} {row['run']}: {row['error'][-2500:]}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--models", nargs="+", default=["qwen2.5-0.5b", "qwen2.5-1.5b", "qwen3-1.7b"])
    parser.add_argument("--tiny", action="store_true", help="qwen2.5-tiny only (a CPU check, < 2 minutes)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--peak-size", type=int, help="the matmul peak's size (default 8192 on CUDA, 2048 on CPU)")
    parser.add_argument("--profile", help="a folder: one torch.profiler table per run")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--json", help="a file for the rows, the device and its peak (bench/gpu_goals.py)")
    parser.add_argument("--variants", nargs="*", default=[],
                        help=f"more flow runs, each a comma-separated subset of {', '.join(VARIANTS)}")
    parser.add_argument("--child", choices=["flow", "transformers", "peak"], help=argparse.SUPPRESS)
    parser.add_argument("--child-extra", default="", help=argparse.SUPPRESS)
    parser.add_argument("--child-dropped", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.peak_size = args.peak_size or (8192 if args.device == "cuda" else 2048)
    if args.child:
        return _run_child(args)
    names = ["qwen2.5-tiny"] if args.tiny else args.models
    unknown = [m for m in names if m not in SHAPES] + [v for v in args.variants for one in v.split(",")
                                                        if one not in VARIANTS]
    if unknown:
        parser.error(f"unknown: {unknown}; models: {list(SHAPES)}, variants: {list(VARIANTS)}")
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    peak = _child(args, "peak")
    rows = []
    for name in names:
        base = _child(args, "transformers", name)
        model_rows = [_row(name, "transformers", base, base, peak)]
        for side, variant in [("flow", ""), *((f"flow {v}", v) for v in args.variants)]:
            model_rows.insert(-1, _row(name, side, _child(args, "flow", name, variant), base, peak))
            if args.json:  # after each run, so that a run cut short by its time limit leaves what it measured
                Path(args.json).write_text(json.dumps({"device": args.device, "peak": peak,
                                                       "rows": rows + model_rows}, indent=1))
        rows += model_rows
    print(f"{args.device}: bf16 matmul peak ({args.peak_size}^3) {peak / 1e12:.2f} TFLOP/s; {args.warmup} warm-up + "
          f"{args.steps} measured steps; model FLOPs: 6 x matmul params + 12 x layers x seq x attention width per "
          "token (full s^2 attention)")
    _print(rows, args.markdown)
    print("goals: flow / transformers >= 1.15; >= 50% of the bf16 peak at 1.5B/1.7B; flow peak memory <= transformers'")
    return 1 if any("error" in row for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

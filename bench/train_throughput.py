"""Training throughput of the pretrain flow against Hugging Face transformers, on the CPU.

The same Qwen2 shape, batch, sequence length and dtype (float32), one process each, in fresh interpreters
taking turns (``--rounds`` of each, so drift on the machine hits all alike; the ratios of the best rates
and of the medians are both printed):

- ``megatron/<provider>``: scripts/pretrain_gpt.py's flow (megatron.training's ``pretrain``) with --mock-data
  (megatron-core GPTModel, DDP, Adam, the schedule's no-pipelining path), once per kernel provider given
  (``--providers``; on a CPU: ``torch``, the default, and ``cuda``, which differ here only in RoPE: the torch
  provider's under megatron's ``apply_rope_fusion``, megatron's own unfused one for cuda), tokens/s over the
  measured iterations, each timed around megatron's ``train_step`` (bench/gpu_train.py's clock);
- ``transformers``: ``Qwen2ForCausalLM`` trained as its ``Trainer`` does by default (fused
  ``torch.optim.AdamW``, gradients clipped to norm 1.0, as ``--clip-grad`` defaults to in the flow):
  forward + backward + clip + step, timed over the same number of iterations after the same warm-up.

Model FLOPs per token are ``flow.model_flops.model_flops_per_token``'s:
6 x matmul parameters + 12 x layers x seq x hidden. The machine's float32 matmul peak is measured here
too (a square ``torch.mm`` of ``--peak-size``), and the flow's achieved FLOP/s is printed as a share of
it. Goals: ratio megatron / transformers >= 1.0; above 50% of the matmul peak on this GEMM-bound shape.

``--baseline REV`` also runs the flow (torch provider) from a worktree of an earlier revision, in the same
rounds, and prints this tree / REV: how a change to the adapter moved the training step.

Usage: python bench/train_throughput.py [--rounds 2] [--iters 6] [--warmup 3] [--baseline REV]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import baseline  # noqa: E402 - bench/ is not a package
# GEMM-bound: hidden 1024 with 16 heads / 4 groups, FFN 2816, seq 512 (attention is ~15% of the FLOPs)
SHAPE = dict(num_layers=4, hidden_size=1024, ffn_hidden_size=2816, num_attention_heads=16, num_query_groups=4,
             vocab_size=8192, seq_length=512)
MICRO_BATCH = 4


def _model():
    sys.path.insert(0, str(ROOT))
    from models.config import ModelConfig

    return ModelConfig(**SHAPE, max_position_embeddings=SHAPE["seq_length"], norm_epsilon=1e-6, rotary_base=1e6,
                       add_qkv_bias=True)  # Qwen2's: RMSNorm, SwiGLU, RoPE, QKV bias, untied


def run_megatron(iters: int, warmup: int) -> float:
    """tokens/s of the pretrain flow (scripts/pretrain_gpt.py's: megatron.training's ``pretrain``) over
    ``iters`` iterations after ``warmup``, each timed around megatron's ``train_step``."""
    sys.path.insert(0, str(ROOT))
    from bench.gpu_train import StepClock, timed_flow
    from models.megatron_lm_args import flags

    argv = [*flags(_model()), "--micro-batch-size", str(MICRO_BATCH), "--global-batch-size", str(MICRO_BATCH),
            "--train-iters", str(warmup + iters), "--lr", "1e-4", "--lr-decay-style", "constant", "--mock-data",
            "--log-interval", "1",
            "--eval-interval", "1000000", "--eval-iters", "0", "--hidden-dropout", "0", "--attention-dropout", "0"]
    if os.environ.get("ADAPTER_KERNELS") == "cuda":
        argv.append("--no-rope-fusion")  # the cuda provider's fused RoPE is Transformer Engine's
    os.environ["ADAPTER_BACKEND"] = "cpu"
    clock = StepClock("cpu", warmup, None)
    timed_flow(argv, clock)
    return MICRO_BATCH * _model().seq_length * len(clock.seconds) / sum(clock.seconds)


def run_transformers(iters: int, warmup: int) -> float:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    m = _model()
    config = Qwen2Config(vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.ffn_hidden_size,
                         num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
                         num_key_value_heads=m.num_query_groups, max_position_embeddings=m.max_position_embeddings,
                         rope_theta=m.rotary_base, rms_norm_eps=m.norm_epsilon, tie_word_embeddings=m.tie_embeddings,
                         attention_dropout=0.0)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)  # Trainer's default since torch 2.8
    tokens = torch.randint(0, m.vocab_size, (MICRO_BATCH, m.seq_length + 1))
    times = []
    for step in range(warmup + iters):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # Trainer's max_grad_norm
        optimizer.step()
        if step >= warmup:
            times.append(time.perf_counter() - start)
    return MICRO_BATCH * m.seq_length * iters / sum(times)


def matmul_peak(size: int, repeats: int = 5) -> float:
    """Best float32 FLOP/s of a square matmul on this machine (torch's threads)."""
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * size ** 3 / best


def _child(kind: str, iters: int, warmup: int, roots: dict | None = None) -> float:
    """One fresh process; a kind ending in ``@REV`` runs from that revision's tree (``roots``)."""
    kind, _, rev = kind.partition("@")
    root = (roots or {}).get(rev, ROOT)
    run, _, provider = kind.partition("/")
    env = {**os.environ, "PYTHONPATH": baseline.pythonpath(root, os.environ), "ADAPTER_BACKEND": "cpu",
           **({"ADAPTER_KERNELS": provider} if provider else {})}
    done = subprocess.run([sys.executable, str(root / "bench" / "train_throughput.py"), "--child", run, "--iters",
                           str(iters), "--warmup", str(warmup)], cwd=root, env=env, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{kind} run failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--peak-size", type=int, default=2048)
    parser.add_argument("--providers", nargs="+", default=["torch", "cuda"], choices=["torch", "cuda"],
                        help="kernel providers to run the flow with")
    parser.add_argument("--baseline", metavar="REV", help="also run the flow from this git revision")
    parser.add_argument("--child", choices=["megatron", "transformers", "peak"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.baseline and "torch" not in args.providers:
        parser.error("--baseline compares the torch provider's flow: keep torch in --providers")
    if args.child:
        value = {"megatron": lambda: run_megatron(args.iters, args.warmup),
                 "transformers": lambda: run_transformers(args.iters, args.warmup),
                 "peak": lambda: matmul_peak(args.peak_size)}[args.child]()
        print("RESULT " + json.dumps(value), flush=True)
        return

    import torch

    sys.path.insert(0, str(ROOT))
    from flow.model_flops import model_flops_per_token

    kinds = [f"megatron/{p}" for p in args.providers] + ["transformers"]
    with contextlib.ExitStack() as stack:
        roots = {args.baseline: stack.enter_context(baseline.worktree(args.baseline))} if args.baseline else {}
        kinds += [f"megatron/torch@{args.baseline}"] if args.baseline else []
        results = {kind: [] for kind in kinds}
        for round_ in range(args.rounds):
            for kind in (kinds if round_ % 2 == 0 else kinds[::-1]):
                results[kind].append(_child(kind, args.iters, args.warmup, roots))
    peak = _child("peak", args.iters, args.warmup)
    model = _model()
    flops_per_token = model_flops_per_token(model, model.seq_length)
    best = {kind: max(rates) for kind, rates in results.items()}
    median = {kind: statistics.median(rates) for kind, rates in results.items()}
    print(f"train throughput on CPU: torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{os.cpu_count()} CPUs; float32, micro batch {MICRO_BATCH} x seq {model.seq_length}, "
          f"{args.warmup} warm-up + {args.iters} measured iterations, best of {args.rounds} rounds each")
    print(f"model: {SHAPE}, {model.num_parameters() / 1e6:.1f} M parameters, "
          f"{flops_per_token / 1e9:.3f} GFLOP per token (training)")
    print(f"float32 matmul peak ({args.peak_size}^3): {peak / 1e9:.1f} GFLOP/s")
    print(f"{'run':<16} {'tokens/s':>9} {'GFLOP/s':>9} {'% of peak':>9} {'/ transformers':>15} {'(medians)':>10}"
          "   all rounds (tokens/s)")
    for kind, rate in best.items():
        print(f"{kind:<16} {rate:9.1f} {rate * flops_per_token / 1e9:9.1f} {100 * rate * flops_per_token / peak:8.1f}% "
              f"{rate / best['transformers']:15.3f} {median[kind] / median['transformers']:10.3f}   "
              f"{', '.join(f'{r:.1f}' for r in results[kind])}")
    if args.baseline:
        base = f"megatron/torch@{args.baseline}"
        print(f"this tree / {args.baseline} (megatron/torch): best {best['megatron/torch'] / best[base]:.3f}, "
              f"medians {median['megatron/torch'] / median[base]:.3f} (above 1: faster now)")
    print("goals: megatron / transformers >= 1.0; megatron above 50% of the matmul peak")


if __name__ == "__main__":
    main()

"""MoE: the experts' grouped GEMM against megatron's per-expert loop, and the pretrain flow's training
throughput on a small MoE model against Hugging Face transformers, on the CPU or a CUDA GPU.

``experts``: one MoE layer's experts, forward + backward on the tokens a top-k router hands them (float32,
``--tokens`` x top-k rows over ``--experts`` experts, uneven as a router makes them). Side by side, same
weights, in one process, interleaved rounds:
- ``sequential``: megatron's ``SequentialMLP``, one ColumnParallelLinear/RowParallelLinear pair per expert
  (what ``moe_grouped_gemm=False`` runs; the per-expert loop to beat);
- ``grouped/<impl>``: megatron's ``TEGroupedMLP`` over the adapter's grouped linear layers, i.e. what
  ``moe_grouped_gemm=True`` gets, once per torch implementation of the grouped GEMM (``loop``: the torch
  provider's, one GEMM per expert on the weights as they are, into slices of one output; ``cat``: the same
  loop composed from autograd ops, outputs concatenated; ``stacked``: torch's grouped GEMM over the
  stacked weight parameter; on
  ``--device cuda`` in bfloat16, ``cuda``: the cuda provider's choice, which is what the flow runs there).

``flow``: tokens/s of the pretrain flow (megatron-core GPTModel with MoE layers, DDP, Adam; --mock-data)
against transformers' ``Qwen3MoeForCausalLM`` of the same configuration (its own experts implementation:
torch's grouped_mm in transformers 5), each in a fresh interpreter taking turns, one process. Same
precision regime on both sides: float32 on the CPU; on a GPU bf16 mixed precision, i.e. the flow's
``--bf16`` (bf16 compute, float32 main weights in the optimizer) against float32 weights under
``torch.autocast(bfloat16)`` with fused AdamW, as transformers' Trainer runs ``bf16=True``. Shapes
(``--shape``): ``small`` (8 experts top-2, hidden 512) and ``qwen3-30b-a3b`` (two layers of
Qwen3-30B-A3B: hidden 2048, 32 heads / 4 groups of 128, 128 experts top-8, expert FFN 768, seq 4096,
micro-batch 1). Goal: flow / transformers >= 1.5 on a GPU. ``--variants`` runs the flow once more per named
setting: ``one-rank-groups=all`` (ADAPTER_ONE_RANK_GROUPS=all: megatron's one-rank NCCL groups answered on the
calling thread, issue 34's lead at one GPU), ``one-rank-groups=none`` (every one-rank group left to its library).

``host``: the flow's host work per step against transformers' on the CPU at the ``tiny`` shape (or ``--shape``),
where both are launch-bound as the GPU's small-shape step is: ms per step, the flow's ms per step in
``get_batch`` (reading, collating and handing over the batch), and from one profiled run per side the aten ops
per step with the copies and host syncs among them (``aten::_local_scalar_dense``: an ``.item()`` or a
tensor's truth value, a sync on a GPU). Both counts are what a GPU step pays for in launches and waits.

Usage: python bench/moe.py [experts|flow|all|host] [--rounds 3] [--device cpu|cuda]
       [--shape small|qwen3-30b-a3b|tiny] [--variants one-rank-groups=all]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPES = {
    # a small Qwen3-MoE-like shape: 8 experts, top-2, GEMM-bound on a CPU
    "small": dict(num_layers=2, hidden_size=512, moe_ffn_hidden_size=512, num_experts=8, topk=2, heads=8,
                  groups=4, head_dim=64, vocab_size=4096, seq_length=512, micro_batch=2),
    # two of Qwen3-30B-A3B's layers (its config.json), its vocabulary, seq 4096
    "qwen3-30b-a3b": dict(num_layers=2, hidden_size=2048, moe_ffn_hidden_size=768, num_experts=128, topk=8,
                          heads=32, groups=4, head_dim=128, vocab_size=151936, seq_length=4096, micro_batch=1),
    # so small that a step is host work on either side (``host``): what a GPU step waits on when launch-bound
    "tiny": dict(num_layers=2, hidden_size=64, moe_ffn_hidden_size=64, num_experts=8, topk=2, heads=4, groups=2,
                 head_dim=16, vocab_size=512, seq_length=64, micro_batch=2),
}
# ``flow --variants``: each one's environment for a flow run of its own, beside the default one
VARIANTS = {f"one-rank-groups={setting}": {"ADAPTER_ONE_RANK_GROUPS": setting} for setting in ("all", "none")}
# ``host``: the ops counted per step (copies and host syncs: what the GPU profile's host-bound step spent on)
HOST_OPS = ("aten::copy_", "aten::_to_copy", "aten::_local_scalar_dense", "aten::item", "aten::nonzero")
MOE = dict(SHAPES["small"])
_SHAPE = ["small"]  # the name of the shape MOE holds


def _expert_layers(tokens: int):
    """Both expert layers on one set of weights, and a routed batch (rows grouped by expert)."""
    import torch
    from megatron.core.transformer import TransformerConfig

    from tests.test_moe_kernels import _both_expert_layers

    config = TransformerConfig(num_layers=1, hidden_size=MOE["hidden_size"], num_attention_heads=MOE["heads"],
                               num_moe_experts=MOE["num_experts"], moe_ffn_hidden_size=MOE["moe_ffn_hidden_size"],
                               moe_router_topk=MOE["topk"], moe_grouped_gemm=True, gated_linear_unit=True,
                               activation_func=torch.nn.functional.silu, add_bias_linear=False,
                               bias_activation_fusion=False, use_cpu_initialization=True, cuda_graph_scope=[])
    grouped, sequential = (layer.to(_device(), _dtype()) for layer in _both_expert_layers(config))
    generator = torch.Generator().manual_seed(0)
    choice = torch.rand(tokens, MOE["num_experts"], generator=generator).topk(MOE["topk"]).indices
    splits = torch.bincount(choice.flatten(), minlength=MOE["num_experts"])
    rows = torch.randn(int(splits.sum()), MOE["hidden_size"], generator=generator)
    probs = torch.rand(len(rows), generator=generator)
    return grouped, sequential, rows.to(_device(), _dtype()), splits, probs.to(_device(), _dtype())


def _device() -> torch.device:
    return torch.device(os.environ.get("ADAPTER_BACKEND", "cpu"))


def _dtype() -> torch.dtype:
    """float32 on the CPU; bfloat16 on a GPU, as one trains there (and what its grouped GEMM takes)."""
    return torch.float32 if _device().type == "cpu" else torch.bfloat16


def _sync() -> None:
    if _device().type == "cuda":
        torch.cuda.synchronize()


def concatenated_grouped_mm(x, weight, tokens_per_expert):
    """The per-expert loop composed from autograd ops, the torch provider's before it wrote its GEMMs into
    one output: the experts' outputs concatenated in forward, the split's gradients in backward."""
    rows = x.split(torch.as_tensor(tokens_per_expert).tolist())
    return torch.cat([torch.nn.functional.linear(part, expert) for part, expert in zip(rows, weight)])


def stacked_grouped_mm(x, weight, tokens_per_expert):
    """The candidate to the torch provider's per-expert loop: one call of torch's grouped GEMM over the
    stacked weight [E, out, in], read in place. Float32 only: on the CPU torch 2.13's kernel drops bf16/fp16
    gradients (they come back None), and it needs rows of whole 16-byte multiples and contiguous incoming
    gradients."""
    ends = torch.as_tensor(tokens_per_expert, device=x.device).cumsum(0, dtype=torch.int32)
    return torch.nn.functional.grouped_mm(x, weight.transpose(1, 2), offs=ends)


def _step_seconds(experts, rows, splits, probs) -> float:
    x = rows.clone().requires_grad_()
    _sync()
    start = time.perf_counter()
    out, _ = experts(x, splits, probs)
    out.backward(torch.ones_like(out))
    _sync()
    return time.perf_counter() - start


def _use(layer, impl) -> None:
    """Point the grouped layer's two projections at ``impl`` (None: the sequential layer, nothing to do)."""
    if impl is not None:
        for linear in (layer.linear_fc1, layer.linear_fc2):
            linear.grouped_mm = impl


def _check_agreement(runs: dict, rows, splits, probs) -> None:
    """Every implementation computes the same experts (float32 rounding apart) before any is timed."""
    outputs = []
    for layer, impl in runs.values():
        _use(layer, impl)
        outputs.append(layer(rows, splits, probs)[0].detach())
    tolerance = 1e-4 if _dtype() == torch.float32 else 5e-2
    for out in outputs[1:]:
        torch.testing.assert_close(out, outputs[0], atol=tolerance, rtol=tolerance)


def bench_experts(rounds: int, tokens: int, repeats: int) -> dict:
    import adapter  # noqa: F401 - before megatron
    from adapter.kernels import cuda_provider, torch_provider
    from tests.kernel_reference import one_rank_model_parallel

    impls = {"loop": torch_provider.looped_grouped_mm, "cat": concatenated_grouped_mm, "stacked": stacked_grouped_mm}
    if _device().type == "cuda":
        impls["cuda"] = cuda_provider.grouped_mm
    with one_rank_model_parallel():
        grouped, sequential, rows, splits, probs = _expert_layers(tokens)
        runs = {"sequential": (sequential, None), **{f"grouped/{k}": (grouped, f) for k, f in impls.items()}}
        _check_agreement(runs, rows, splits, probs)
        times = {name: [] for name in runs}
        for round_ in range(rounds + 1):  # the first round warms up
            for name, (layer, impl) in runs.items():
                _use(layer, impl)
                best = min(_step_seconds(layer, rows, splits, probs) for _ in range(repeats))
                if round_:
                    times[name].append(best)
    return {"rows": len(rows), "splits": splits.tolist(), "seconds": times}


def print_experts(result: dict) -> None:
    seconds = {name: statistics.median(values) for name, values in result["seconds"].items()}
    base = seconds["sequential"]
    print(f"experts: {MOE['num_experts']} x (hidden {MOE['hidden_size']}, ffn {MOE['moe_ffn_hidden_size']}, "
          f"SwiGLU), {result['rows']} routed rows {result['splits']}, {_dtype()} on {_device()}, "
          "forward + backward")
    print(f"{'run':<16} {'ms':>8} {'sequential / run':>17}   rounds (ms)")
    for name, value in seconds.items():
        print(f"{name:<16} {1e3 * value:8.2f} {base / value:17.3f}   "
              f"{', '.join(f'{1e3 * v:.2f}' for v in result['seconds'][name])}")


def _flow_argv(iters: int, warmup: int) -> list[str]:
    from models.megatron_lm_args import null_vocabulary

    m = MOE
    return ["--num-layers", str(m["num_layers"]), "--hidden-size", str(m["hidden_size"]),
            "--ffn-hidden-size", str(m["moe_ffn_hidden_size"]), "--num-attention-heads", str(m["heads"]),
            "--group-query-attention", "--num-query-groups", str(m["groups"]), "--kv-channels", str(m["head_dim"]),
            "--qk-layernorm",
            "--max-position-embeddings", str(m["seq_length"]), "--seq-length", str(m["seq_length"]),
            "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--swiglu", "--disable-bias-linear",
            "--position-embedding-type", "rope", "--rotary-base", "1000000",
            "--untie-embeddings-and-output-weights", *null_vocabulary(m["vocab_size"]),
            "--num-experts", str(m["num_experts"]), "--moe-router-topk", str(m["topk"]),
            "--moe-ffn-hidden-size", str(m["moe_ffn_hidden_size"]), "--moe-grouped-gemm",
            "--moe-token-dispatcher-type", "alltoall", "--moe-router-load-balancing-type", "aux_loss",
            "--moe-aux-loss-coeff", "0.001",
            "--micro-batch-size", str(m["micro_batch"]), "--global-batch-size", str(m["micro_batch"]),
            "--train-iters", str(warmup + iters), "--lr", "1e-4", "--lr-decay-style", "constant", "--mock-data",
            "--log-interval", "1",
            "--eval-interval", "1000000", "--eval-iters", "0", "--hidden-dropout", "0", "--attention-dropout", "0",
            *(["--bf16"] if _dtype() == torch.bfloat16 else []), *_cuda_fusions()]


def _cuda_fusions() -> list[str]:
    """On a GPU, megatron's fused token permutation, as Megatron-LM's MoE recipes and scripts/pretrain_qwen3_*
    ask for it (megatron.training's default is off on every backend, kept as Megatron-LM's)."""
    return ["--moe-permute-fusion"] if _device().type == "cuda" else []


def _result(rate: float, clock) -> dict:
    """tokens/s, and with a profile each op's calls per measured step."""
    steps = max(len(clock.seconds), 1)
    return {"rate": rate, "ops": {name: count / steps for name, count in clock.op_counts.items()}}


def run_flow(iters: int, warmup: int, profile: str | None) -> dict:
    """tokens/s of the pretrain flow over ``iters`` iterations after ``warmup``, each timed around its
    ``train_step`` between device syncs as transformers' step is (bench/gpu_train.py's clock: data,
    forward, backward and the optimizer step; not the log line the loop writes between steps, which
    transformers' side has no counterpart of). With ``profile``, a torch.profiler table of the measured
    iterations there and each op's calls per step (the flow's whole loop between steps included)."""
    from bench.gpu_train import StepClock, timed_flow
    from flow import gpt

    clock = StepClock(_device().type, warmup, profile)
    batch_seconds = _timed_batches(gpt)
    timed_flow(_flow_argv(iters, warmup), clock)
    return {**_result(MOE["micro_batch"] * MOE["seq_length"] * len(clock.seconds) / sum(clock.seconds), clock),
            "batch_ms": 1e3 * sum(batch_seconds[warmup:]) / max(len(batch_seconds) - warmup, 1)}


def _timed_batches(gpt) -> list:
    """The seconds of each of the flow's ``get_batch`` calls (one per iteration here, one micro-batch):
    reading, collating and handing the batch to the device, the host work of its data path."""
    seconds, get_batch = [], gpt.get_batch

    def timed(*args, **kwargs):
        start = time.perf_counter()
        batch = get_batch(*args, **kwargs)
        seconds.append(time.perf_counter() - start)
        return batch

    gpt.get_batch = timed
    return seconds


def run_transformers(iters: int, warmup: int, profile: str | None) -> dict:
    """tokens/s of ``Qwen3MoeForCausalLM`` trained as its Trainer does (fused AdamW, clip 1.0; on a GPU
    ``bf16=True``: float32 weights, the forward under bf16 autocast)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    m = MOE
    config = Qwen3MoeConfig(vocab_size=m["vocab_size"], hidden_size=m["hidden_size"],
                            intermediate_size=m["moe_ffn_hidden_size"], moe_intermediate_size=m["moe_ffn_hidden_size"],
                            num_hidden_layers=m["num_layers"], num_attention_heads=m["heads"],
                            num_key_value_heads=m["groups"], head_dim=m["head_dim"], num_experts=m["num_experts"],
                            num_experts_per_tok=m["topk"], norm_topk_prob=True, decoder_sparse_step=1,
                            max_position_embeddings=m["seq_length"], rope_theta=1e6, rms_norm_eps=1e-6,
                            tie_word_embeddings=False, router_aux_loss_coef=0.001, output_router_logits=True)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).to(_device()).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    autocast = torch.autocast(_device().type, torch.bfloat16, enabled=_dtype() == torch.bfloat16)
    tokens = torch.randint(0, m["vocab_size"], (m["micro_batch"], m["seq_length"] + 1), device=_device())
    from bench.gpu_train import StepClock

    def train_step():
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            loss = model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    clock = StepClock(_device().type, warmup, profile)
    step = clock(train_step)
    clock.around(lambda: [step() for _ in range(warmup + iters)])
    return _result(m["micro_batch"] * m["seq_length"] * iters / sum(clock.seconds), clock)


def _child(kind: str, iters: int, warmup: int, profile: str | None) -> dict:
    """One run in a fresh interpreter: ``kind`` is ``flow``, ``transformers`` or ``flow <variant>``."""
    side, _, variant = kind.partition(" ")
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "ADAPTER_BACKEND": _device().type, **VARIANTS.get(variant, {})}
    shape = ["--shape", _SHAPE[0], "--experts", str(MOE["num_experts"]), "--topk", str(MOE["topk"]),
             "--expert-ffn", str(MOE["moe_ffn_hidden_size"])]
    if profile:
        shape += ["--profile", str(Path(profile) / f"moe-{_SHAPE[0]}-{kind.replace(' ', '-')}.txt")]
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "moe.py"), "--child", side, "--iters", str(iters),
                           "--warmup", str(warmup), *shape], cwd=ROOT, env=env, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{kind} run failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def bench_flow(rounds: int, iters: int, warmup: int, profile: str | None, variants=()) -> dict:
    """Rates per kind (the flow, transformers, the flow under each of ``variants``), the kinds taking turns;
    with ``profile`` (a folder) the last round's runs are profiled, the others untouched by the profiler."""
    kinds = ("flow", "transformers", *(f"flow {variant}" for variant in variants))
    results = {kind: [] for kind in kinds}
    for round_ in range(rounds):
        last = profile if round_ == rounds - 1 else None
        for kind in (kinds if round_ % 2 == 0 else kinds[::-1]):
            results[kind].append(_child(kind, iters, warmup, last)["rate"])
    return results


def _flow_rates(args) -> dict:
    """bench_flow's rates, written with ``--json`` (a failed run's message there instead)."""
    record = {"shape": _SHAPE[0], "device": _device().type}
    try:
        results = bench_flow(args.rounds, args.iters, args.warmup, args.profile, args.variants)
    except SystemExit as failure:
        if args.json:
            Path(args.json).write_text(json.dumps({**record, "error": str(failure)[-4000:]}, indent=1))
        raise
    if args.json:
        Path(args.json).write_text(json.dumps({**record, **results}, indent=1))
    return results


def print_flow(results: dict, iters: int, warmup: int) -> None:
    best = {kind: max(rates) for kind, rates in results.items()}
    median = {kind: statistics.median(rates) for kind, rates in results.items()}
    where = torch.cuda.get_device_name() if _device().type == "cuda" else f"{torch.get_num_threads()} threads"
    regime = ("bf16 mixed precision both sides (flow --bf16 with float32 main weights; transformers float32 "
              "weights under bf16 autocast)" if _dtype() == torch.bfloat16 else "float32 both sides")
    print(f"flow vs transformers: {_SHAPE[0]} {MOE}, {regime}, {warmup} warm-up + {iters} measured iterations, "
          f"{len(results['flow'])} rounds, torch {torch.__version__}, {where}")
    width = max(14, *map(len, results))
    print(f"{'run':<{width}} {'tokens/s':>9} {'/ transformers':>15} {'(medians)':>10}   all rounds (tokens/s)")
    for kind in results:
        print(f"{kind:<{width}} {best[kind]:9.1f} {best[kind] / best['transformers']:15.3f} "
              f"{median[kind] / median['transformers']:10.3f}   {', '.join(f'{r:.1f}' for r in results[kind])}")
    print("goal on a GPU: flow / transformers >= 1.5")


def bench_host(rounds: int, iters: int, warmup: int, profile: str | None) -> dict:
    """The ``tiny`` shape on the CPU, where both sides' steps are host work: step time per round (no
    profiler), then one profiled run per side for its ops per step (its table kept in ``profile``)."""
    rates = bench_flow(rounds, iters, warmup, None)
    with tempfile.TemporaryDirectory(prefix="moe-host-") as folder:
        runs = {kind: _child(kind, iters, warmup, profile or folder) for kind in rates}
    return {"rates": rates, "ops": {kind: run["ops"] for kind, run in runs.items()},
            "batch_ms": runs["flow"]["batch_ms"]}


def print_host(result: dict, iters: int, warmup: int) -> None:
    rates, ops = result["rates"], result["ops"]
    step_ms = {kind: 1e3 * MOE["micro_batch"] * MOE["seq_length"] / max(r) for kind, r in rates.items()}
    print(f"host work per step, {_SHAPE[0]} MoE {MOE}, CPU float32, {torch.get_num_threads()} threads, "
          f"{warmup} warm-up + {iters} measured iterations, best of {len(rates['flow'])} rounds; ops per step from "
          "one profiled run")
    header = ["run", "ms/step", "/ transformers", "batch ms/step", "aten ops", *HOST_OPS]
    print("| " + " | ".join(header) + " |\n|" + " --- |" * len(header))
    for kind in rates:
        aten = sum(count for name, count in ops[kind].items() if name.startswith("aten::"))
        batch = f"{result['batch_ms']:.2f}" if kind == "flow" else "-"
        cells = [kind, f"{step_ms[kind]:.1f}", f"{step_ms[kind] / step_ms['transformers']:.2f}", batch, f"{aten:.0f}",
                 *(f"{ops[kind].get(name, 0):.0f}" for name in HOST_OPS)]
        print("| " + " | ".join(cells) + " |")
    for kind in rates:
        top = sorted(((c, n) for n, c in ops[kind].items() if n.startswith("aten::")), reverse=True)[:12]
        print(f"{kind}: most called per step: " + ", ".join(f"{n[6:]} {c:.0f}" for c, n in top))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", nargs="?", choices=["experts", "flow", "all", "host"], default="all")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens routed to the experts (x top-k rows)")
    parser.add_argument("--shape", choices=sorted(SHAPES), help="the model's shape (default: small; host: tiny)")
    parser.add_argument("--experts", type=int, help="how many experts (default: the shape's)")
    parser.add_argument("--topk", type=int, help="experts per token (default: the shape's)")
    parser.add_argument("--expert-ffn", type=int, help="expert FFN (default: the shape's)")
    parser.add_argument("--repeats", type=int, default=3, help="steps per round; the best counts")
    parser.add_argument("--iters", type=int, default=6, help="flow: measured iterations per run")
    parser.add_argument("--warmup", type=int, default=3, help="flow: warm-up iterations per run")
    parser.add_argument("--device", choices=["cpu", "cuda"], help="where to run (sets ADAPTER_BACKEND; default cpu)")
    parser.add_argument("--profile", help="flow: a folder for torch.profiler tables of the last round's runs "
                                          "(in a child: the table's file)")
    parser.add_argument("--variants", nargs="*", default=[], choices=sorted(VARIANTS),
                        help="flow: the flow once more per setting named (see the docstring)")
    parser.add_argument("--json", help="flow: a file for the rates (or the failure) for bench/gpu_goals.py")
    parser.add_argument("--child", choices=["flow", "transformers"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.what == "host" and (args.device or "cpu") != "cpu":
        parser.error("host measures the CPU at the tiny shape: leave out --device")
    if args.device:
        os.environ["ADAPTER_BACKEND"] = args.device
    os.environ.setdefault("ADAPTER_BACKEND", "cpu")
    _SHAPE[0] = args.shape or ("tiny" if args.what == "host" else "small")
    MOE.clear()
    MOE.update(SHAPES[_SHAPE[0]])
    given = dict(num_experts=args.experts, topk=args.topk, moe_ffn_hidden_size=args.expert_ffn)
    MOE.update({name: value for name, value in given.items() if value is not None})
    if args.child:
        run = run_flow if args.child == "flow" else run_transformers
        print("RESULT " + json.dumps(run(args.iters, args.warmup, args.profile)), flush=True)
        return
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    if args.what == "host":
        return print_host(bench_host(args.rounds, args.iters, args.warmup, args.profile), args.iters, args.warmup)
    if args.what in ("experts", "all"):
        print_experts(bench_experts(args.rounds, args.tokens, args.repeats))
    if args.what in ("flow", "all"):
        print_flow(_flow_rates(args), args.iters, args.warmup)


if __name__ == "__main__":
    main()

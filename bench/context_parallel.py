"""Context parallelism: per-rank activation memory and time of CP2 against CP1, on the CPU, in one run.

Why: context parallelism (``context_parallel_size`` > 1, the adapter's core attention over the CP group,
adapter/kernels/context_parallel.py) exists to cut what one rank holds for a long sequence. This measures
what it cuts, and what it costs in time, on a small megatron-core GPT model trained as megatron trains it.

What runs: two gloo ranks (tests/distributed.py's ``run_ranks``, one thread each). Every rank builds, with
one seed, the same GPTModel (``models.provider.transformer_config`` / ``build_model``; RMSNorm, SwiGLU,
RoPE, untied embeddings, fp32, batch 1, the adapter's torch kernel provider) three times:

- ``CP1``: built after ``initialize_model_parallel(context_parallel_size=1)``; each rank runs the whole
  sequence (two independent replicas, so that both cores are as busy as under CP2);
- ``CP2 p2p`` (ring attention) and ``CP2 a2a`` (Ulysses): built after
  ``initialize_model_parallel(context_parallel_size=2)`` with that ``cp_comm_type``; each rank runs its
  half of the sequence as ``megatron.core.utils.get_batch_on_this_cp_rank`` splits it (chunks r and 3-r of
  4; through ``flow.releases.batch_on_this_cp_rank``, which calls it as each release wants).

Every module keeps the process groups it was built with, so the three models run side by side, in turns.
Before measuring, the CP2 models are checked against CP1 on the shortest sequence: the loss summed over the
CP ranks and the parameter gradients summed over them equal CP1's.

Per sequence length and model, one forward + backward of the language-model loss (summed over tokens):
- **saved MiB**: the bytes autograd saves for backward on this rank, i.e. the activation memory: distinct
  storages packed by ``torch.autograd.graph.saved_tensors_hooks`` during the forward, parameters excluded.
  Exact and deterministic. For the longest sequence it is also broken down by the module that saved it;
- **peak RSS MiB**: the growth of the rank's resident set over a forward + backward (``VmHWM`` after,
  reset through ``/proc/self/clear_refs`` and ``malloc_trim`` before, less ``VmRSS`` before): includes
  what is transient (attention blocks, gradients of activations, the ring's buffers) and the allocator's
  habits, so approximate;
- **ms**: median over ``--rounds`` of the slower rank's forward + backward, after a warm-up; the models
  take turns within each round, the order rotating, so drift on the machine hits all alike.

Ratios are CP2 / CP1 per rank (below 1: less memory, faster). The goal for memory is at most 0.55.

Usage: python bench/context_parallel.py [--seq-lengths 2048 4096 8192] [--layers 2] [--hidden 256]
                                        [--heads 8] [--rounds 3] [--markdown]
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MIB = 2 ** 20
RUNS = ("CP1", "CP2 p2p", "CP2 a2a")


# ------------------------------------------------------------------------------------------- on each rank
def _model_config(opts: dict):
    import models

    longest = max(opts["seq_lengths"])
    return models.get("gpt-tiny", num_layers=opts["layers"], hidden_size=opts["hidden"],
                      ffn_hidden_size=opts["ffn"], num_attention_heads=opts["heads"],
                      num_query_groups=opts["heads"], vocab_size=opts["vocab"],
                      max_position_embeddings=longest, seq_length=longest)


def _build(model_config, cp: int, kind: str | None):
    """The GPTModel on the parallel state initialised now, from seed 1234 (the same weights every time)."""
    import torch

    from models.provider import build_model, transformer_config

    overrides = dict(context_parallel_size=cp)
    if kind is not None:
        overrides["cp_comm_type"] = kind
    config = transformer_config(model_config, **overrides)
    torch.manual_seed(1234)
    return build_model(model_config, config)


def _models(model_config) -> dict:
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(context_parallel_size=1)
    built = {"CP1": _build(model_config, 1, None)}
    parallel_state.destroy_model_parallel()  # forgets the groups; the CP1 model keeps its own
    parallel_state.initialize_model_parallel(context_parallel_size=2)
    built["CP2 p2p"] = _build(model_config, 2, "p2p")
    built["CP2 a2a"] = _build(model_config, 2, "a2a")
    return built


def _batches(seq: int, vocab: int) -> dict:
    """The whole batch (CP1) and this rank's half of it as megatron splits it (CP2)."""
    import torch

    from flow.releases import batch_on_this_cp_rank

    tokens = torch.randint(0, vocab, (1, seq + 1), generator=torch.Generator().manual_seed(seq))
    whole = dict(tokens=tokens[:, :-1].contiguous(), labels=tokens[:, 1:].contiguous(),
                 position_ids=torch.arange(seq).unsqueeze(0))
    half = batch_on_this_cp_rank({k: v.clone() for k, v in whole.items()})  # the CP2 state is current
    return {"CP1": whole, "CP2 p2p": half, "CP2 a2a": half}


def _loss(model, batch):
    losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])  # [b, s] per token
    return losses.sum()


def _step(model, batch) -> None:
    model.zero_grad(set_to_none=False)
    _loss(model, batch).backward()


def _parameter_storages(model) -> set:
    return {p.untyped_storage().data_ptr() for p in model.parameters()}


def _saved(model, batch) -> tuple[int, dict]:
    """(bytes saved for backward, those bytes by the innermost module running when each was saved)."""
    import torch

    params, seen, by_module, stack = _parameter_storages(model), set(), {}, []
    names = {module: name for name, module in model.named_modules()}

    def enter(module, _inputs):
        stack.append(names.get(module, "?"))

    def leave(module, _inputs, _output):
        stack.pop()

    def pack(t):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in params and ptr not in seen:
            seen.add(ptr)
            where = re.sub(r"\.\d+\.", ".*.", stack[-1] if stack else "?") or "GPTModel (loss)"
            by_module[where] = by_module.get(where, 0) + storage.nbytes()
        return t

    hooks = [m.register_forward_pre_hook(enter) for m in names] + [m.register_forward_hook(leave) for m in names]
    try:
        model.zero_grad(set_to_none=False)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = _loss(model, batch)
    finally:
        for hook in hooks:
            hook.remove()
    loss.backward()
    return sum(by_module.values()), by_module


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _peak_rss_growth(model, batch) -> int | None:
    """Bytes the resident set grows by, at its peak, over one forward + backward; None where Linux's peak
    cannot be reset."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        before = _status_kib("VmRSS")
    except (OSError, KeyError, AttributeError):
        return None
    _step(model, batch)
    return (_status_kib("VmHWM") - before) * 1024


def _check(built: dict, batches: dict) -> dict:
    """Largest |CP2 - CP1| of the loss (summed over the CP ranks) and of every parameter gradient (summed
    over them), relative to CP1's largest."""
    import torch.distributed as dist

    reference = built["CP1"]
    reference.zero_grad(set_to_none=False)
    loss = _loss(reference, batches["CP1"])
    loss.backward()
    grads = [p.grad.clone() for p in reference.parameters()]
    scale = max(g.abs().max().item() for g in grads)
    out = {}
    for name in RUNS[1:]:
        model = built[name]
        model.zero_grad(set_to_none=False)
        mine = _loss(model, batches[name])
        mine.backward()
        total = mine.detach().clone()
        dist.all_reduce(total)
        worst = 0.0
        for p, g in zip(model.parameters(), grads):
            summed = p.grad.clone()
            dist.all_reduce(summed)
            worst = max(worst, (summed - g).abs().max().item() / scale)
        out[name] = {"loss": abs(total.item() - loss.item()) / abs(loss.item()), "grad": worst}
    return out


def measure(opts: dict) -> dict:
    """On every rank: the three models, the check, then per sequence length the saved bytes, the peak RSS
    growth and the step times. Returns rank-local figures (times: the slower rank's)."""
    import adapter
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    adapter.init_distributed()
    if dist.get_world_size() != 2:
        raise SystemExit("bench/context_parallel.py runs on 2 ranks")
    built = _models(_model_config(opts))
    for model in built.values():
        model.train()
    result = {"check": _check(built, _batches(min(opts["seq_lengths"]), opts["vocab"])), "seq": {},
              "threads": torch.get_num_threads()}
    longest = max(opts["seq_lengths"])
    for seq in opts["seq_lengths"]:
        batches = _batches(seq, opts["vocab"])
        row = {name: {"seconds": []} for name in RUNS}
        for name in RUNS:  # the warm-up: saved bytes, then the peak RSS growth
            saved, by_module = _saved(built[name], batches[name])
            row[name].update(saved=saved, rss=_peak_rss_growth(built[name], batches[name]))
            if seq == longest:
                row[name]["by_module"] = by_module
        for round_ in range(opts["rounds"]):
            for i in range(len(RUNS)):
                name = RUNS[(round_ + i) % len(RUNS)]
                dist.barrier()
                start = time.perf_counter()
                _step(built[name], batches[name])
                took = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
                dist.all_reduce(took, op=dist.ReduceOp.MAX)
                row[name]["seconds"].append(took.item())
        result["seq"][seq] = row
    parallel_state.destroy_model_parallel()
    return result


# ------------------------------------------------------------------------------------------- the launcher
def _render(header: list[str], rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        lines = [header, ["---", "---"] + ["---:"] * (len(header) - 2)] + rows
        return "\n".join("| " + " | ".join(line) + " |" for line in lines)
    widths = [max(len(line[i]) for line in [header] + rows) for i in range(len(header))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(line, widths)) for line in [header] + rows)


def _mib(value) -> str:
    return "n/a" if value is None else f"{value / MIB:.1f}"


def _ratio(a, b) -> str:
    return "n/a" if a is None or b is None or not b else f"{a / b:.3f}"


def _cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                 if line.startswith("model name")]
        if names:
            return names[0]
    return platform.processor() or platform.machine()


def _load() -> str:
    try:
        one, five, _ = os.getloadavg()
    except OSError:
        return "load average unknown"
    return f"load average {one:.1f} (1 min) / {five:.1f} (5 min)"


def report(result: dict, opts: dict, markdown: bool) -> None:
    checks = ", ".join(f"{name}: loss {c['loss']:.1e}, grads {c['grad']:.1e}" for name, c in result["check"].items())
    print(f"check against CP1 at seq {min(opts['seq_lengths'])} (relative |CP2 summed over ranks - CP1|): {checks}")
    header = ["seq", "cp_comm_type", "CP1 saved MiB", "CP2 saved MiB/rank", "saved x",
              "CP1 peak RSS MiB", "CP2 peak RSS MiB/rank", "RSS x", "CP1 ms", "CP2 ms", "time x"]
    rows = []
    for seq, row in result["seq"].items():
        one = row["CP1"]
        one_ms = statistics.median(one["seconds"]) * 1e3
        for name in RUNS[1:]:
            two = row[name]
            two_ms = statistics.median(two["seconds"]) * 1e3
            rows.append([str(seq), name.split()[1], _mib(one["saved"]), _mib(two["saved"]),
                         _ratio(two["saved"], one["saved"]), _mib(one["rss"]), _mib(two["rss"]),
                         _ratio(two["rss"], one["rss"]), f"{one_ms:.0f}", f"{two_ms:.0f}", _ratio(two_ms, one_ms)])
    print()
    print(_render(header, rows, markdown))
    longest = max(result["seq"])
    parts = result["seq"][longest]
    modules = sorted({m for name in RUNS for m in parts[name]["by_module"]},
                     key=lambda m: -parts["CP1"]["by_module"].get(m, 0))
    print(f"\nsaved MiB per rank by module at seq {longest} (layers' modules summed over the layers)\n")
    rows = []
    for module in modules:
        one = parts["CP1"]["by_module"].get(module, 0)
        cells = [module, "", _mib(one)]
        for name in RUNS[1:]:
            two = parts[name]["by_module"].get(module, 0)
            cells += [_mib(two), _ratio(two, one)]
        rows.append(cells)
    print(_render(["module", "", "CP1", "CP2 p2p", "p2p x", "CP2 a2a", "a2a x"], rows, markdown))
    for seq, row in result["seq"].items():
        print(f"seq {seq} ms per round: " + "; ".join(
            f"{name} {', '.join(f'{1e3 * s:.0f}' for s in row[name]['seconds'])}" for name in RUNS))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-lengths", type=int, nargs="+", default=[2048, 4096, 8192],
                        help="sequence lengths, multiples of 4 (default 2048 4096 8192)")
    parser.add_argument("--layers", type=int, default=2, help="transformer layers (default 2)")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size (default 256)")
    parser.add_argument("--heads", type=int, default=8, help="attention heads, no GQA (default 8)")
    parser.add_argument("--ffn", type=int, help="SwiGLU FFN size (default 3 x hidden)")
    parser.add_argument("--vocab", type=int, default=4096, help="vocabulary rows (default 4096)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds after the warm-up (default 3)")
    parser.add_argument("--markdown", action="store_true", help="print markdown tables")
    args = parser.parse_args()
    if min(args.seq_lengths) < 4 or any(s % 4 for s in args.seq_lengths):
        parser.error("--seq-lengths: CP2 splits a sequence in 4 chunks; give multiples of 4")
    if args.heads % 2 or args.hidden % args.heads or args.rounds < 1 or args.layers < 1:
        parser.error("--heads must be even (Ulysses splits them over 2 ranks) and divide --hidden; "
                     "--rounds and --layers >= 1")
    opts = dict(seq_lengths=sorted(args.seq_lengths), layers=args.layers, hidden=args.hidden, heads=args.heads,
                ffn=args.ffn or 3 * args.hidden, vocab=args.vocab, rounds=args.rounds)

    sys.path.insert(0, str(ROOT))
    import torch

    from bench.context_parallel import measure  # by module name: the ranks import it so
    from tests.distributed import run_ranks

    print(f"context parallelism on {_cpu_name()}, {os.cpu_count()} CPUs; {_load()}")
    print(f"torch {torch.__version__}, python {platform.python_version()}; 2 gloo ranks, 1 thread each; "
          f"GPT {opts['layers']} layers, hidden {opts['hidden']}, {opts['heads']} heads, FFN {opts['ffn']} "
          f"(SwiGLU), vocab {opts['vocab']}, RoPE, fp32, batch 1, torch kernel provider; "
          f"forward + backward of the summed LM loss, median of {opts['rounds']} after a warm-up")
    print("ratios = CP2 / CP1 per rank (below 1: less, faster); goal: saved x <= 0.55")
    started = time.perf_counter()
    env = {"ADAPTER_BACKEND": "cpu", "ADAPTER_KERNELS": "torch"}
    result = run_ranks(2, measure, opts, env=env, timeout=3600)[0]
    report(result, opts, args.markdown)
    print(f"\n(measured in {time.perf_counter() - started:.0f} s; {_load()} after)")


if __name__ == "__main__":
    main()

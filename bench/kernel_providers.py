"""Kernel benchmark: each kernel provider's ops against megatron-core's own local path, in one run.

Why: the adapter replaces megatron's local implementations (``WrappedTorchNorm``, the unfused SwiGLU,
``_apply_rotary_pos_emb_bshd``, ``vocab_parallel_cross_entropy``, ``DotProductAttention``) with a kernel
provider's (adapter.kernels). This shows what that buys, per op and sequence length, in time and memory.

What is measured, for megatron's local path and every available provider on the same inputs:
- time of one forward + backward (gradients of every input and parameter), median of ``--repeats``
  samples after a warm-up; the candidates take turns within each round (the order rotates round by
  round), so drift on the machine hits all of them alike;
- saved activation bytes: what autograd keeps for backward during the forward (distinct storages packed
  by ``torch.autograd.graph.saved_tensors_hooks``). Device-neutral: it shows the O(S^2) score matrix of
  megatron's attention against the O(S) of flash attention on a CPU as well;
- on an accelerator, peak allocated memory during forward + backward, less what was allocated before.
Before timing, each provider's forward output is compared with megatron's (fp32: 1e-4, bf16: 5e-2,
absolute and relative); a provider that differs shows MISMATCH and is not timed.

How to read the tables: ``time x``, ``mem x`` (saved bytes) and ``peak x`` are provider / megatron local,
so below 1 is faster or smaller than megatron's local path; ``megatron ms`` and ``megatron MiB`` are the
local path's absolute figures. ``n/a``: the provider has no kernel of its own for the op and leaves
megatron's in place. The npu provider is measured only with ``--device npu`` (a real torch_npu and an
Ascend NPU); on CPU the cuda provider runs PyTorch SDPA's CPU kernels.

Usage: python bench/kernel_providers.py [--device cpu|cuda|npu] [--seq 256 512 ...] [--dtype fp32|bf16]
                               [--batch 1] [--repeats 7] [--markdown]
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2}
DEFAULT_SEQ = {"cpu": [256, 512, 1024], "cuda": [1024, 2048, 4096, 8192], "npu": [1024, 2048, 4096, 8192]}
HIDDEN, FFN, VOCAB = 1024, 4096, 32000  # norm width, SwiGLU output width, cross-entropy vocabulary
HEADS, GROUPS, HEAD_DIM = 8, 2, 128  # attention (GQA) and RoPE
WARMUP = 2  # unmeasured calls per candidate first (torch.compile'd megatron kernels compile here)
MIN_SAMPLE_S = 0.05  # a sample repeats the call until it lasts about this long
MIB = 2 ** 20


# ------------------------------------------------------------------------------------------- the ops
# Each op: (inputs(seq, batch), megatron's local function or module, provider's or None). Inputs requiring
# grad are differentiated; the others (targets, angles) are passed along. The builders run after
# ``import adapter``, so they import megatron themselves.
def _randn(*shape, seed, dtype, device, scale=1.0):
    values = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale
    return values.to(device, dtype).requires_grad_()


def _config(dtype, **overrides):
    from tests.kernel_reference import attention_config

    return attention_config(heads=HEADS, groups=GROUPS, head_dim=HEAD_DIM, dtype=dtype, **overrides)


def norm_inputs(seq, batch, dtype, device):
    return [_randn(seq, batch, HIDDEN, seed=0, dtype=dtype, device=device)]


def norm_local(dtype, device):
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    norm = WrappedTorchNorm(_config(dtype, normalization="RMSNorm"), hidden_size=HIDDEN, eps=1e-5)
    return norm.to(device, dtype)


def norm_provider(provider, dtype, device):
    from adapter import kernels

    norm = kernels.norm_module(provider)(_config(dtype, normalization="RMSNorm"), hidden_size=HIDDEN, eps=1e-5)
    return norm.to(device, dtype)


def swiglu_inputs(seq, batch, dtype, device):
    return [_randn(seq, batch, 2 * FFN, seed=0, dtype=dtype, device=device)]


def swiglu_local(dtype, device):
    from tests.kernel_reference import megatron_swiglu

    return lambda x: megatron_swiglu(x, None)


def swiglu_provider(provider, dtype, device):
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

    swiglu = provider.bias_swiglu or bias_swiglu_impl
    return lambda x: swiglu(x, None)


def rope_inputs(seq, batch, dtype, device):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)
    freqs = torch.cat((angles, angles), dim=-1)[:, None, None, :].to(device)  # megatron's [s, 1, 1, d]
    return [_randn(seq, batch, HEADS, HEAD_DIM, seed=0, dtype=dtype, device=device), freqs]


def rope_local(dtype, device):
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    return _apply_rotary_pos_emb_bshd


def rope_provider(provider, dtype, device):
    return provider.rope


def cross_entropy_inputs(seq, batch, dtype, device):
    target = torch.randint(0, VOCAB, (seq, batch), generator=torch.Generator().manual_seed(1)).to(device)
    return [_randn(seq, batch, VOCAB, seed=0, dtype=dtype, device=device, scale=3.0), target]


def cross_entropy_local(dtype, device):
    # megatron's overwrites fp32 logits in place (as in training); each candidate has its own inputs
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    return vocab_parallel_cross_entropy


def cross_entropy_provider(provider, dtype, device):
    from megatron.core import parallel_state

    if provider.vocab_parallel_cross_entropy is None:
        return None
    group = parallel_state.get_tensor_model_parallel_group()
    return lambda logits, target: provider.vocab_parallel_cross_entropy(logits, target, group)


def attention_inputs(seq, batch, dtype, device):
    return [_randn(seq, batch, heads, HEAD_DIM, seed=seed, dtype=dtype, device=device)
            for seed, heads in enumerate((HEADS, GROUPS, GROUPS))]


def _causal_attention(module_class, dtype, device):
    from megatron.core.transformer.enums import AttnMaskType

    module = module_class(_config(dtype), layer_number=1, attn_mask_type=AttnMaskType.causal,
                          attention_type="self").to(device)
    return lambda q, k, v: module(q, k, v, None)


def attention_local(dtype, device):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    return _causal_attention(DotProductAttention, dtype, device)


def attention_provider(provider, dtype, device):
    from adapter import kernels

    return _causal_attention(kernels.core_attention_module(provider), dtype, device)


OPS = {
    f"RMSNorm (hidden {HIDDEN})": (norm_inputs, norm_local, norm_provider),
    f"SwiGLU ({2 * FFN} -> {FFN})": (swiglu_inputs, swiglu_local, swiglu_provider),
    f"RoPE ({HEADS} heads x {HEAD_DIM})": (rope_inputs, rope_local, rope_provider),
    f"cross entropy (vocab {VOCAB})": (cross_entropy_inputs, cross_entropy_local, cross_entropy_provider),
    f"core attention (causal, {HEADS} heads / {GROUPS} groups x {HEAD_DIM})":
        (attention_inputs, attention_local, attention_provider),
}


# ------------------------------------------------------------------------------------- measurements
def step(fn, inputs):
    """One forward + backward of ``fn(*inputs)``: gradients of the inputs that require grad and of
    ``fn``'s parameters when it is a module."""
    params = list(fn.parameters()) if isinstance(fn, torch.nn.Module) else []
    out = fn(*inputs)
    torch.autograd.grad(out, [t for t in inputs if t.requires_grad] + params, torch.ones_like(out))
    return out


def seconds_per_step(fn, inputs, number: int) -> float:
    """Wall seconds of one forward + backward, averaged over ``number`` back-to-back calls."""
    from adapter import device

    device.synchronize()
    start = time.perf_counter()
    for _ in range(number):
        step(fn, inputs)
    device.synchronize()
    return (time.perf_counter() - start) / number


def saved_bytes(fn, inputs) -> int:
    """Bytes autograd saves for backward during the forward of ``fn(*inputs)`` (distinct storages)."""
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        storages[(storage.device, storage.data_ptr())] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*inputs)
    return sum(storages.values())


def peak_bytes(fn, inputs) -> int:
    """Peak allocated accelerator memory during one forward + backward, less what was allocated before."""
    from adapter import device

    device.synchronize()
    before = device.memory_allocated()
    device.reset_peak_memory_stats()
    step(fn, inputs)
    device.synchronize()
    return device.max_memory_allocated() - before


def measure(candidates: dict, repeats: int, accelerator: bool) -> dict:
    """{name: (median seconds, saved bytes, peak bytes or None)} of (fn, inputs) candidates, timed in turns."""
    for fn, inputs in candidates.values():
        for _ in range(WARMUP):
            step(fn, inputs)
    slowest = max(seconds_per_step(fn, inputs, 1) for fn, inputs in candidates.values())
    number = max(1, math.ceil(MIN_SAMPLE_S / slowest))
    names = list(candidates)
    samples = {name: [] for name in names}
    for rnd in range(repeats):
        for name in names[rnd % len(names):] + names[:rnd % len(names)]:
            samples[name].append(seconds_per_step(*candidates[name], number))
    return {name: (statistics.median(samples[name]), saved_bytes(*candidates[name]),
                   peak_bytes(*candidates[name]) if accelerator else None) for name in names}


def mismatch(fn, inputs, expected, dtype) -> str | None:
    """Why ``fn``'s forward output differs from megatron's ``expected``, or None when it matches."""
    with torch.no_grad():
        got = fn(*inputs).float()
    tol = TOLERANCE[dtype]
    if got.shape != expected.shape:
        return f"shape {tuple(got.shape)} != {tuple(expected.shape)}"
    if torch.allclose(got, expected, atol=tol, rtol=tol):
        return None
    return f"max |diff| {(got - expected).abs().max().item():.2e} > {tol:g}"


def run_op(op, providers, opts, dtype, device, accelerator):
    """Table rows (one per sequence length) and notes of one op."""
    make_inputs, build_local, build_provider = op
    local = build_local(dtype, device)
    built = {p.NAME: build_provider(p, dtype, device) for p in providers}
    width = 3 if accelerator else 2  # cells per provider: time x, mem x (, peak x)
    rows, notes = [], []
    for seq in opts.seq:
        with torch.no_grad():
            expected = local(*make_inputs(seq, opts.batch, dtype, device)).float()
        candidates = {"megatron": (local, make_inputs(seq, opts.batch, dtype, device))}
        cells = {}
        for name, fn in built.items():
            if fn is None:
                cells[name] = ["n/a"] * width
                continue
            problem = mismatch(fn, make_inputs(seq, opts.batch, dtype, device), expected, dtype)
            if problem:
                cells[name] = ["MISMATCH"] + ["-"] * (width - 1)
                notes.append(f"MISMATCH: {name} at seq {seq}: {problem}")
            else:
                candidates[name] = (fn, make_inputs(seq, opts.batch, dtype, device))
        del expected
        results = measure(candidates, opts.repeats, accelerator)
        base_time, base_saved, base_peak = results.pop("megatron")
        for name, (seconds, saved, peak) in results.items():
            cells[name] = [f"{seconds / base_time:.2f}", f"{saved / base_saved:.2f}"]
            if accelerator:
                cells[name].append(f"{peak / base_peak:.2f}")
        row = [str(seq), f"{base_time * 1e3:.2f}", f"{base_saved / MIB:.1f}"]
        if accelerator:
            row.append(f"{base_peak / MIB:.1f}")
        rows.append(row + [cell for name in built for cell in cells[name]])
    return rows, notes


# ------------------------------------------------------------------------------------------ output
def render(header: list[str], rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        lines = [header, ["---"] + ["---:"] * (len(header) - 1)] + rows
        return "\n".join("| " + " | ".join(line) + " |" for line in lines)
    widths = [max(len(line[i]) for line in [header] + rows) for i in range(len(header))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(line, widths)) for line in [header] + rows)


def device_name(device: torch.device) -> str:
    from adapter import device as adapter_device

    if device.type != "cpu":
        return adapter_device.get_device_name()
    model = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                 if line.startswith("model name")]
        model = names[0] if names else model
    return f"{model} (CPU), {torch.get_num_threads()} threads, {os.cpu_count()} CPUs"


def load_average() -> str:
    try:
        one, five, _ = os.getloadavg()
    except OSError:
        return "load average unknown"
    return f"load average {one:.1f} (1 min) / {five:.1f} (5 min)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda", "npu"), default="cpu",
                        help="where to run (sets ADAPTER_BACKEND; default cpu)")
    parser.add_argument("--seq", type=int, nargs="+",
                        help="sequence lengths (default: 256 512 1024 on cpu, 1024 2048 4096 8192 otherwise)")
    parser.add_argument("--dtype", choices=tuple(DTYPES),
                        help="default fp32 on cpu, bf16 on an accelerator (flash kernels take half precision)")
    parser.add_argument("--batch", type=int, default=1, help="micro-batch size (default 1)")
    parser.add_argument("--repeats", type=int, default=7, help="timed samples per candidate (default 7)")
    parser.add_argument("--markdown", action="store_true", help="print markdown tables")
    opts = parser.parse_args()
    opts.seq = opts.seq or DEFAULT_SEQ[opts.device]
    dtype = DTYPES[opts.dtype or ("fp32" if opts.device == "cpu" else "bf16")]
    if opts.repeats < 1 or opts.batch < 1 or min(opts.seq) < 1:
        parser.error("--repeats, --batch and --seq must be >= 1")

    # The backend follows --device; the process's own provider is the torch one, whose patches leave
    # megatron's local implementations (the reference here) in place. adapter comes before megatron.
    os.environ["ADAPTER_BACKEND"] = opts.device
    os.environ["ADAPTER_KERNELS"] = "torch"
    sys.path.insert(0, str(ROOT))
    import adapter
    import megatron.core
    from adapter import kernels
    from tests.kernel_reference import one_rank_model_parallel

    device = adapter.device.torch_device()
    accelerator = device.type != "cpu"
    names = ["torch", "cuda"] + (["npu"] if opts.device == "npu" else [])
    if opts.device == "npu" and getattr(sys.modules.get("torch_npu"), "IS_DOUBLE", False):
        parser.error("torch_npu is the tests' double (tests/doubles on the path): it cannot be timed")
    providers = [kernels.select_provider(name) for name in names]

    print(f"kernel benchmark on {device_name(device)}; {load_average()}")
    print(f"torch {torch.__version__}, megatron-core {megatron.core.__version__}, python "
          f"{platform.python_version()}; {str(dtype).removeprefix('torch.')}, batch {opts.batch}, "
          f"median of {opts.repeats} (after {WARMUP} warm-up calls)")
    if opts.device != "npu":
        print("npu provider: skipped (needs torch_npu and an Ascend NPU: run with --device npu there)")
    print("ratios = provider / megatron local (below 1: faster / smaller); time = forward + backward, "
          "mem = bytes saved for backward" + (", peak = peak allocated" if accelerator else ""))
    header = ["seq", "megatron ms", "megatron MiB"] + (["megatron peak MiB"] if accelerator else [])
    for name in names:
        header += [f"{name} time x", f"{name} mem x"] + ([f"{name} peak x"] if accelerator else [])
    started = time.perf_counter()
    with one_rank_model_parallel():
        for title, op in OPS.items():
            rows, notes = run_op(op, providers, opts, dtype, device, accelerator)
            print(f"\n{'### ' if opts.markdown else ''}{title}\n")
            print(render(header, rows, opts.markdown))
            for note in notes:
                print(note)
    print(f"\n(measured in {time.perf_counter() - started:.0f} s; {load_average()} after)")


if __name__ == "__main__":
    main()

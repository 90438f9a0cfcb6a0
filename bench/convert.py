"""Conversion throughput and peak memory: a synthetic Qwen2-shaped checkpoint of about 1 B parameters
(bf16, random weights, in 1 GiB safetensors shards) converted HF -> mcore and back with
``scripts/convert_checkpoint.py``, each direction in its own fresh process.

For each direction it prints the wall time, the throughput (checkpoint bytes / wall time) and the peak
resident memory of the converting process (``wait4``'s ru_maxrss) as a ratio to the checkpoint's size on
disk (goal: under 25%). Python, torch and megatron alone take a fixed few hundred MB whatever the model,
so the same command converting a 64-wide one-layer model is measured too: peak minus that baseline is
what streaming the checkpoint holds. The round trip is checked bit-exact.

Usage: python bench/convert.py [--layers 20] [--workdir DIR] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GOAL = 0.25
SHARD_BYTES = 2**30


def _synthetic_hf(directory: Path, layers: int, size: str = "1b") -> int:
    """A Qwen2 config.json and random bf16 weights for it, written shard by shard; returns the bytes.
    ``size`` "tiny" is a 64-wide model: converting it costs what the converter costs with nothing to do."""
    import torch
    from safetensors.torch import save_file

    from models.config import ModelConfig
    from models.hf import config_to_hf

    width = dict(hidden_size=2048, ffn_hidden_size=5632, num_attention_heads=16, num_query_groups=4,
                 vocab_size=32000) if size == "1b" else dict(
                 hidden_size=64, ffn_hidden_size=176, num_attention_heads=4, num_query_groups=2, vocab_size=512)
    model = ModelConfig(num_layers=layers, **width, max_position_embeddings=4096, seq_length=4096,
                        norm_epsilon=1e-6, rotary_base=1e6, add_qkv_bias=True)
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config_to_hf(model, "Qwen2ForCausalLM"), indent=2))
    h, f, d = model.hidden_size, model.ffn_hidden_size, model.head_dim
    q, kv = model.num_attention_heads * d, model.num_query_groups * d
    shapes = {"model.embed_tokens.weight": (model.vocab_size, h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "self_attn.q_proj.weight": (q, h),
                       p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.k_proj.bias": (kv,), p + "self_attn.v_proj.weight": (kv, h),
                       p + "self_attn.v_proj.bias": (kv,), p + "self_attn.o_proj.weight": (h, q),
                       p + "post_attention_layernorm.weight": (h,), p + "mlp.gate_proj.weight": (f, h),
                       p + "mlp.up_proj.weight": (f, h), p + "mlp.down_proj.weight": (h, f)})
    shapes.update({"model.norm.weight": (h,), "lm_head.weight": (model.vocab_size, h)})
    generator = torch.Generator().manual_seed(0)
    shard, size, files, weight_map, total = {}, 0, [], {}, 0

    def flush():
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shard, str(directory / name), metadata={"format": "pt"})
        files.append(name)
        weight_map.update({k: name for k in shard})

    for name, shape in shapes.items():
        tensor = torch.randn(shape, generator=generator, dtype=torch.float32).to(torch.bfloat16)
        if shard and size + tensor.nbytes > SHARD_BYTES:
            flush()
            shard, size = {}, 0
        shard[name] = tensor
        size += tensor.nbytes
        total += tensor.nbytes
    flush()
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}))
    return total


def _run(argv: list[str]) -> tuple[float, int]:
    """Wall seconds and peak RSS bytes of one fresh process."""
    env = {**os.environ, "ADAPTER_BACKEND": "cpu", "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    _, status, usage = os.wait4(proc.pid, 0)
    elapsed = time.perf_counter() - start
    output = proc.stdout.read().decode()
    proc.stdout.close()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{output[-4000:]}")
    return elapsed, usage.ru_maxrss * 1024


def _bit_exact(a: Path, b: Path) -> bool:
    import torch
    from safetensors import safe_open

    def tensors(directory):
        out = {}
        for file in sorted(directory.glob("*.safetensors")):
            with safe_open(file, framework="pt") as f:
                out.update({k: file for k in f.keys()})
        return out

    left, right = tensors(a), tensors(b)
    if sorted(left) != sorted(right):
        return False
    for name in left:
        with safe_open(left[name], framework="pt") as f, safe_open(right[name], framework="pt") as g:
            if not torch.equal(f.get_tensor(name), g.get_tensor(name)):
                return False
    return True


def _helper(argv: list[str]) -> str:
    """Run this script's ``--helper`` step in a child: the measuring process stays small, since a child
    starts as a copy of its parent and ru_maxrss would count the parent's pages."""
    done = subprocess.run([sys.executable, __file__, "--helper", *argv], cwd=ROOT, check=True,
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return done.stdout.strip()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=20, help="20 layers: about 1.03 B parameters")
    parser.add_argument("--workdir", help="where to write (default: a temporary directory)")
    parser.add_argument("--keep", action="store_true", help="keep the files")
    parser.add_argument("--helper", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.helper:
        step, *rest = args.helper
        print(_synthetic_hf(Path(rest[0]), int(rest[1]), *rest[2:]) if step == "make" else
              _bit_exact(Path(rest[0]), Path(rest[1])))
        return
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-convert-"))
    try:
        hf_dir = work / "hf"
        shutil.rmtree(work, ignore_errors=True)
        nbytes = int(_helper(["make", str(hf_dir), str(args.layers)]))
        on_disk = sum(p.stat().st_size for p in hf_dir.glob("*.safetensors"))
        script = "scripts/convert_checkpoint.py"
        tiny = work / "tiny"
        _helper(["make", str(tiny), "1", "tiny"])
        _, baseline = _run([script, "hf-to-mcore", "--hf-dir", str(tiny), "--save-dir", str(work / "tiny-mcore"),
                            "--no-progress"])
        rows = []
        wall, peak = _run([script, "hf-to-mcore", "--hf-dir", str(hf_dir), "--save-dir", str(work / "mcore"),
                           "--no-progress"])
        rows.append(("hf -> mcore", wall, peak))
        wall, peak = _run([script, "mcore-to-hf", "--load-dir", str(work / "mcore"), "--save-dir",
                           str(work / "hf-back"), "--max-shard-size", "1GB", "--no-progress"])
        rows.append(("mcore -> hf", wall, peak))
        exact = _helper(["check", str(hf_dir), str(work / "hf-back")])
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    mib = 2**20
    print(f"checkpoint: {nbytes // 2 / 1e9:.3f} B bf16 parameters, "
          f"{on_disk / mib:.0f} MiB of safetensors; {os.cpu_count()} CPUs")
    print(f"baseline (the same command on a 1-layer, 64-wide model): peak RSS {baseline / mib:.0f} MiB "
          f"= {baseline / on_disk:.3f} x checkpoint")
    print(f"{'direction':<12} {'wall s':>7} {'GB/s':>6} {'peak RSS MiB':>13} {'x checkpoint':>13} "
          f"{'above baseline MiB':>19} {'goal < 0.25':>11}")
    for name, wall, peak in rows:
        print(f"{name:<12} {wall:7.1f} {on_disk / wall / 1e9:6.2f} {peak / mib:13.0f} {peak / on_disk:13.3f} "
              f"{(peak - baseline) / mib:19.0f} {'yes' if peak / on_disk < GOAL else 'NO':>11}")
    print(f"round trip bit-exact: {exact}")


if __name__ == "__main__":
    main()

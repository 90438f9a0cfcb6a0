"""Convert model weights between Hugging Face safetensors and megatron's torch_dist checkpoint format.

    python scripts/convert_checkpoint.py hf-to-mcore --hf-dir Qwen2.5-72B --save-dir ckpt/qwen72b --tp 8 --pp 4
    python scripts/convert_checkpoint.py mcore-to-hf --load-dir ckpt/qwen72b --save-dir Qwen2.5-72B-trained

hf-to-mcore writes a release checkpoint that the pretrain flow (and Megatron-LM) loads with
``--load <save-dir>``. torch_dist keeps every tensor whole (in chunks) and megatron reshards it when
loading, so the checkpoint loads at any TP/PP/EP; --tp/--pp/--ep are checked against the model and recorded.
mcore-to-hf reads a checkpoint saved at any TP/PP/EP (a converted one or one from training) and writes
safetensors shards, config.json and the tokenizer files. Both stream: peak memory is about one layer plus
one safetensors shard. Supported architectures: Qwen2ForCausalLM (Qwen2 / Qwen2.5), LlamaForCausalLM,
Qwen3ForCausalLM, Qwen3MoeForCausalLM, the hybrid Qwen3.5 / Qwen3-Next, and DeepseekV3ForCausalLM (DeepSeek-V3/R1,
Kimi-K2; its MTP layer included, FP8 block-quantized weights read as bf16).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runnable from a checkout
os.environ.setdefault("ADAPTER_BACKEND", "cpu")  # conversion never needs an accelerator

import adapter  # noqa: E402,F401  - before megatron

import models  # noqa: E402
from adapter import checkpoint_unpickling  # noqa: E402
from models.config import ModelConfigError  # noqa: E402
from models.conversion import DTYPES, ConversionError, hf_to_mcore, mcore_to_hf  # noqa: E402


def _release_freed_blocks_to_the_os() -> None:
    """glibc serves allocations below a threshold that grows (up to 32 MB) as big blocks are freed from
    its heap, which it seldom gives back: streaming one 32 MB block after another would then keep a few
    hundred MB resident. A fixed 1 MB threshold gives every block its own mapping, unmapped when freed.
    This process only, and only on glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, 2**20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def _size(text: str) -> int:
    units = {"KB": 2**10, "MB": 2**20, "GB": 2**30, "TB": 2**40}
    for unit, factor in units.items():
        if text.upper().endswith(unit):
            return int(float(text[:-2]) * factor)
    return int(text)


def _convert(args) -> Path:
    if args.direction == "hf-to-mcore":
        return hf_to_mcore(args.hf_dir, args.save_dir, tp=args.tp, pp=args.pp, ep=args.ep, dtype=args.dtype,
                           progress=not args.no_progress)
    return mcore_to_hf(args.load_dir, args.save_dir, iteration=args.iteration,
                       model=models.get(args.model) if args.model else None, dtype=args.dtype,
                       max_shard_bytes=args.max_shard_size, tokenizer_dir=args.tokenizer_dir,
                       progress=not args.no_progress)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="direction", required=True)
    to_mcore = sub.add_parser("hf-to-mcore", help="Hugging Face directory -> megatron checkpoint")
    to_mcore.add_argument("--hf-dir", required=True, help="directory with config.json and *.safetensors")
    to_mcore.add_argument("--save-dir", required=True, help="megatron checkpoint directory (--load for training)")
    to_mcore.add_argument("--tp", type=int, default=1, help="tensor parallel size it is meant for")
    to_mcore.add_argument("--pp", type=int, default=1, help="pipeline parallel size it is meant for")
    to_mcore.add_argument("--ep", type=int, default=1, help="expert parallel size it is meant for (MoE models)")
    to_hf = sub.add_parser("mcore-to-hf", help="megatron checkpoint -> Hugging Face directory")
    to_hf.add_argument("--load-dir", required=True, help="megatron checkpoint directory (as given to --save)")
    to_hf.add_argument("--save-dir", required=True, help="new Hugging Face model directory")
    to_hf.add_argument("--iteration", help="iteration to convert (default: the latest)")
    to_hf.add_argument("--model", choices=models.names(), metavar="NAME",
                       help="the model, when the checkpoint does not say (one of: "
                            + ", ".join(models.names()) + ")")
    to_hf.add_argument("--tokenizer-dir", help="copy tokenizer files from here (default: those converted in)")
    to_hf.add_argument("--max-shard-size", type=_size, default=_size("5GB"), help="per safetensors file")
    for p in (to_mcore, to_hf):
        p.add_argument("--dtype", choices=list(DTYPES), help="cast the weights (default: keep theirs)")
        p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    _release_freed_blocks_to_the_os()
    try:
        with checkpoint_unpickling.as_refusal():
            path = _convert(args)
    except (ConversionError, ModelConfigError, checkpoint_unpickling.UntrustedCheckpoint) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

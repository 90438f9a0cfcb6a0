"""Check a conversion: the same token ids through the Hugging Face model and through megatron-core loaded
from the converted checkpoint, on CPU in float32; prints the largest absolute logit difference.

    python -m models.verify --hf-dir D [--load O] [--tp N] [--pp M] [--ep E]

Without ``--load`` it converts ``--hf-dir`` itself first (into a temporary directory). With TP x PP x EP > 1
it starts that many gloo ranks through torchrun (a MoE model's experts split over EP, the expert tensor
parallel size being TP's, as megatron defaults it). Exit status 0 when the difference is within ``--atol``,
1 when it is not, 2 on bad input. Needs ``transformers`` for the HF side (``pip install -e .[hf]``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import torch


def megatron_logits(chunks: list, tokens: torch.Tensor, model) -> torch.Tensor | None:
    """Full-vocabulary logits [batch, seq, vocab] of megatron ``chunks`` (this rank's, any TP/PP/VPP) for
    ``tokens``, on the ranks of the last pipeline stage; None elsewhere."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)

    def gathered(output, non_loss_data=False):
        return gather_from_tensor_model_parallel_region(output)

    def forward_step(data_iterator, chunk):
        next(data_iterator)
        return chunk(tokens, positions, None), gathered

    with torch.no_grad():
        outputs = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=[iter([tokens]) for _ in chunks]
            if len(chunks) > 1 else iter([tokens]),
            model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=1,
            seq_length=tokens.shape[1], micro_batch_size=tokens.shape[0], forward_only=True,
            collect_non_loss_data=True)
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return None
    return outputs[0][..., :model.vocab_size].float()


def hf_logits(hf_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as exc:
        raise SystemExit(f"models.verify needs transformers for the Hugging Face side: "
                         f"pip install -e '.[hf]' ({exc})") from exc
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(input_ids=tokens).logits.float()


def _rank_main(args) -> int:
    import adapter  # before megatron
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from .torch_dist_io import load_model_weights
    from .conversion import read_hf_config
    from .provider import build_model, transformer_config
    from pathlib import Path

    _, model = read_hf_config(Path(args.hf_dir))
    adapter.init_distributed()
    parallel_state.initialize_model_parallel(args.tp, args.pp, expert_model_parallel_size=args.ep)
    model_parallel_cuda_manual_seed(args.seed)
    config = transformer_config(model, perform_initialization=False)
    chunks = [build_model(model, config)]
    for chunk in chunks:
        chunk.eval()
    load_model_weights(chunks, args.load)
    generator = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, model.vocab_size, (args.batch_size, args.seq_length), generator=generator)
    ours = megatron_logits(chunks, tokens, model)
    status = 0
    reporter = (ours is not None and parallel_state.get_tensor_model_parallel_rank() == 0
                and parallel_state.get_data_parallel_rank() == 0)
    if reporter:
        reference = hf_logits(args.hf_dir, tokens)
        diff = (ours - reference).abs().max().item()
        ok = diff <= args.atol
        print(f"max |logit difference| {diff:.3e} over {tuple(reference.shape)} logits (TP {args.tp}, PP "
              f"{args.pp}, EP {args.ep}; atol {args.atol:g}): {'OK' if ok else 'MISMATCH'}", flush=True)
        status = 0 if ok else 1
    verdict = torch.tensor([status], device=adapter.device.torch_device())  # NCCL/HCCL reduce device tensors
    torch.distributed.all_reduce(verdict, op=torch.distributed.ReduceOp.MAX)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return int(verdict.item())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m models.verify", description=__doc__.splitlines()[0])
    parser.add_argument("--hf-dir", required=True, help="the Hugging Face model directory")
    parser.add_argument("--load", help="the converted megatron checkpoint (default: convert --hf-dir now)")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel size to load at")
    parser.add_argument("--pp", type=int, default=1, help="pipeline parallel size to load at")
    parser.add_argument("--ep", type=int, default=1, help="expert parallel size to load at (MoE models)")
    parser.add_argument("--seq-length", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--atol", type=float, default=1e-4, help="largest absolute logit difference accepted")
    parser.add_argument("--seed", type=int, default=1234)
    argv = list(argv if argv is not None else sys.argv[1:])
    args = parser.parse_args(argv)
    # float32 on CPU, in this command's processes: the comparison is about the weights
    os.environ.setdefault("ADAPTER_BACKEND", "cpu")

    from pathlib import Path

    from adapter import checkpoint_dir, checkpoint_unpickling

    from . import torch_dist_io
    from .config import ModelConfigError
    from .conversion import ConversionError, hf_to_mcore, read_hf_config

    if "WORLD_SIZE" in os.environ:  # a rank started below
        return _rank_main(args)
    try:
        read_hf_config(Path(args.hf_dir))[1].check_layout(args.tp, args.pp, ep=args.ep)
        if args.load is not None:  # its pickles read here first: a refused one is this process's one line
            with checkpoint_unpickling.as_refusal():
                torch_dist_io.tensors_metadata(checkpoint_dir.iteration_dir(Path(args.load)))
        with tempfile.TemporaryDirectory(prefix="verify-") as tmp:
            if args.load is None:
                hf_to_mcore(args.hf_dir, tmp, tp=args.tp, pp=args.pp, ep=args.ep, progress=False)
                argv += ["--load", tmp]
            world = args.tp * args.pp * args.ep
            if world == 1:
                return _rank_main(parser.parse_args(argv))
            return subprocess.call([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                    f"--nproc_per_node={world}", "-m", "models.verify", *argv])
    except (ConversionError, ModelConfigError, checkpoint_unpickling.UntrustedCheckpoint,
            checkpoint_dir.CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

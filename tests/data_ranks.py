"""Rank functions for tests/test_data.py: scripts/pretrain_gpt.py's dataset provider and get_batch (flow.gpt)
behind megatron.training's data loader, on real gloo ranks."""

from __future__ import annotations

import sys

import adapter  # noqa: F401  - before megatron
import torch
from megatron.core import parallel_state

from scripts.preprocess_data import build_tokenizer


def _setup(tp: int, pp: int, data_prefix: str, tokenizer_model: str, cache: str, with_mask: bool):
    """megatron.training's arguments (its parser's defaults) and tokenizer as its globals, over ``tp`` x ``pp``."""
    from megatron.training import global_vars
    from megatron.training.arguments import parse_args

    adapter.init_distributed()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    sys.argv = ["pretrain_gpt.py"]
    args = parse_args()
    vars(args).update(
        tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model=tokenizer_model, data_path=[data_prefix],
        split="98,2,0", seq_length=32, seed=1234, data_cache_path=cache, micro_batch_size=2, global_batch_size=2,
        dataloader_type="single", num_workers=0, create_attention_mask_in_dataloader=with_mask,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=False,
        context_parallel_size=1, distributed_timeout_minutes=1, mock_data=False)
    tokenizer = build_tokenizer(args)
    args.padded_vocab_size = tokenizer.vocab_size
    global_vars.set_args(args)
    global_vars._GLOBAL_TOKENIZER = tokenizer
    return args


def batches_on_rank(tp: int, pp: int, data_prefix: str, tokenizer_model: str, cache: str, steps: int = 3,
                    with_mask: bool = False) -> dict:
    """What this rank's get_batch returns for ``steps`` micro-batches, with the rank's dataset role; data-reading
    ranks also report the samples' tokens and labels their loader should have delivered (straight from the
    dataset)."""
    from megatron.training.datasets.data_samplers import build_pretraining_data_loader

    from flow import gpt

    _setup(tp, pp, data_prefix, tokenizer_model, cache, with_mask)
    train, _, _ = gpt.train_valid_test_datasets_provider([64, 8, 0])
    loader = build_pretraining_data_loader(train, 0)
    iterator = iter(loader) if loader is not None else None
    batches = [gpt.get_batch(iterator) for _ in range(steps)]
    expected = labels = None
    if train is not None:
        expected, labels = ([torch.stack([train[i][key] for i in range(2 * s, 2 * s + 2)]) for s in range(steps)]
                            for key in ("tokens", "labels"))
    torch.distributed.barrier()
    return {"rank": torch.distributed.get_rank(),
            "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
            "has_dataset": train is not None, "batches": batches, "expected_tokens": expected,
            "expected_labels": labels}

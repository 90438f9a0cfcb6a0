"""Rank functions for tests/test_data.py: the dataset provider, data loader and get_batch on real gloo ranks."""

from __future__ import annotations

import argparse

import adapter  # noqa: F401  - before megatron
import torch
from megatron.core import parallel_state

from adapter.training import data, global_vars
from adapter.training.tokenizer import build_tokenizer


def _setup(tp: int, pp: int, data_prefix: str, tokenizer_model: str, cache: str,
           with_mask: bool = False) -> argparse.Namespace:
    adapter.init_distributed()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    args = argparse.Namespace(
        tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model=tokenizer_model, data_path=[data_prefix],
        split="98,2,0", seq_length=32, seed=1234, data_cache_path=cache, micro_batch_size=2,
        dataloader_type="single", num_workers=0, create_attention_mask_in_dataloader=with_mask,
        distributed_timeout_minutes=1)
    tokenizer = build_tokenizer(args)
    args.padded_vocab_size = tokenizer.vocab_size
    global_vars.set_args(args)
    global_vars.set_tokenizer(tokenizer)
    return args


def batches_on_rank(tp: int, pp: int, data_prefix: str, tokenizer_model: str, cache: str, steps: int = 3,
                    with_mask: bool = False) -> dict:
    """What this rank's get_batch returns for ``steps`` micro-batches, with the rank's dataset role; data-reading
    ranks also report the samples their loader should have delivered (straight from the dataset)."""
    args = _setup(tp, pp, data_prefix, tokenizer_model, cache, with_mask)
    train, _, _ = data.train_valid_test_datasets_provider([64, 8, 0])
    loader = data.build_pretraining_data_loader(train, 0, args)
    iterator = iter(loader) if loader is not None else None
    batches = [data.get_batch(iterator) for _ in range(steps)]
    expected = None
    if train is not None:
        expected = [torch.stack([train[i]["tokens"] for i in range(2 * s, 2 * s + 2)]) for s in range(steps)]
    torch.distributed.barrier()
    return {"rank": torch.distributed.get_rank(),
            "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
            "has_dataset": train is not None, "batches": batches, "expected_tokens": expected}

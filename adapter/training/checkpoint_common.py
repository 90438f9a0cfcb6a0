"""The plain state of a training checkpoint as Megatron-LM's ``megatron/training/checkpointing.py`` writes and
reads it beside the tensors, so that a checkpoint moves between Megatron-LM's pretrain_gpt.py (through
``adapter.run``) and the flow, either way, with the same model flags.

Megatron-LM reads three things the flow kept otherwise, and the flow reads them back from its checkpoints:

- ``args``: Megatron-LM keeps its arguments in the checkpoint, the consumed samples among them, and reads from
  them the TP and PP sizes (whether the RNG states are restored), the consumed samples (where the data resumes;
  without them it starts the data over) and a few model sizes it compares (``check_checkpoint_args``). The flow
  writes its own arguments there, plain values only (any reader unpickles them, with or without this project),
  with the consumed samples; from a checkpoint without its own ``consumed_*``/``layout`` values (Megatron-LM's)
  it reads them from ``args``.
- ``content_metadata`` (megatron's ``save(content_metadata=)``): how the distributed optimizer's state is
  sharded (``distrib_optim_sharding_type``). Megatron-LM builds its load from it; without it, it takes the
  deprecated ``dp_zero_gather_scatter`` and fails on the flow's ``fully_reshardable`` state. The flow loads
  with what a checkpoint names, so it also reads Megatron-LM's default, ``dp_reshardable``.
- the RNG states under Megatron-LM's names (``get_rng_state``'s); the flow's checkpoints before named them
  ``random``, ``numpy``, ``torch``, ``device``, ``tracker``, which it still reads.
"""

from __future__ import annotations

import argparse

from adapter.earlier_checkpoints import FLOW_OPTIMIZER_FORMAT

# one that reshards across TP and PP as well as DP (megatron's DistributedOptimizer lists them)
FULLY_RESHARDABLE = ("fully_reshardable", "fully_sharded_model_space", "fsdp_dtensor")
_PLAIN = (bool, int, float, str, type(None))
# the sizes that shape a checkpoint's tensors, as the arguments name them -> as the flow's model config does
SHAPING_SIZES = {"num_layers": "num_layers", "hidden_size": "hidden_size", "ffn_hidden_size": "ffn_hidden_size",
                 "num_attention_heads": "num_attention_heads", "padded_vocab_size": "vocab_size"}
NULL_VOCABULARY = (" (Megatron-LM 0.19's NullTokenizer holds --vocab-size entries, the flow's one more, the "
                   "end-of-document id after them, as Megatron-LM's before 0.19: give the flow Megatron-LM's "
                   "--vocab-size less one)")
# the model sizes Megatron-LM's check_checkpoint_args compares with its own arguments on a resume
COMPARED_SIZES = ("num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings")


def saved_args(args: argparse.Namespace, consumed: dict) -> argparse.Namespace:
    """The arguments as Megatron-LM saves its own: every plain value (objects the flow derives, such as its
    model config, left out), with the consumed samples it reads back."""
    def plain(value) -> bool:
        if isinstance(value, (list, tuple)):
            return all(plain(v) for v in value)
        return isinstance(value, _PLAIN)

    values = {name: value for name, value in vars(args).items() if plain(value)}
    config = getattr(args, "model_config", None)  # a --model run's sizes are its config's, not arguments
    values.update({name: getattr(config, name) for name in COMPARED_SIZES if config is not None})
    return argparse.Namespace(**values, consumed_train_samples=consumed["train"],
                              consumed_valid_samples=consumed["valid"], skipped_train_samples=0)


def content_metadata(args: argparse.Namespace) -> dict:
    """What Megatron-LM's ``_build_sharded_state_dict_metadata`` records for the flow's save: the distributed
    optimizer's state fully reshardable (the flow's one format, Megatron-LM's
    ``--dist-ckpt-optim-fully-reshardable``)."""
    metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if args.use_distributed_optimizer:
        metadata.update(distrib_optim_sharding_type="fully_reshardable",
                        distrib_optim_fully_reshardable_mem_efficient=False)
    return metadata


def refuse_another_model(common: dict, args: argparse.Namespace, checkpoint) -> None:
    """One line where the checkpoint's arguments (Megatron-LM's, or the flow's) name a model of other sizes than
    this run builds. megatron reads a tensor saved larger into a smaller one without a word (an embedding of 384
    rows into one of 256), and Megatron-LM's own check compares the vocabulary only for a file tokenizer."""
    from adapter.training.arguments import ArgumentError

    saved = common.get("args")
    for name, field in SHAPING_SIZES.items():
        was, now = getattr(saved, name, None), getattr(args.model_config, field)
        if was is not None and was != now:
            why = NULL_VOCABULARY if name == "padded_vocab_size" and args.tokenizer_type == "NullTokenizer" else ""
            raise ArgumentError(f"--load {checkpoint}: it holds a model of {name} {was}, this run builds {now}"
                                f"{why}: load it with the model flags that saved it")


def loading_metadata(common: dict) -> dict:
    """The sharding the checkpoint's optimizer state was saved in, for the optimizer's sharded state dict;
    the flow's where the checkpoint names none (the flow's before, or one saved without the distributed
    optimizer, which its fully reshardable state reads as before)."""
    return {**FLOW_OPTIMIZER_FORMAT, **(common.get("content_metadata") or {})}


def layout(args) -> dict:
    """The parallel layout of a run (its arguments, or the ``args`` a checkpoint holds)."""
    return {"tp": args.tensor_model_parallel_size, "pp": args.pipeline_model_parallel_size,
            "vpp": args.virtual_pipeline_model_parallel_size, "dp": args.data_parallel_size,
            "ep": args.expert_model_parallel_size,
            "etp": args.expert_tensor_parallel_size or args.tensor_model_parallel_size}


def saved_layout(common: dict) -> dict:
    """The layout that saved the checkpoint: the flow's record, else its ``args``' (Megatron-LM's)."""
    if "layout" in common or common.get("args") is None:
        return common.get("layout", {})
    return layout(common["args"])


def consumed_samples(common: dict) -> dict:
    """The training and validation samples consumed up to the checkpoint: the flow's record, else its
    ``args``' (Megatron-LM's)."""
    if "consumed_train_samples" in common:
        return {"train": common["consumed_train_samples"], "valid": common["consumed_valid_samples"]}
    args = common.get("args")
    return {"train": getattr(args, "consumed_train_samples", 0), "valid": getattr(args, "consumed_valid_samples", 0)}

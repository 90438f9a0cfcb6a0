"""torch_dist checkpoints that the project's own training loop saved before it recorded what megatron.training
reads beside the tensors, read by megatron.training's ``load_checkpoint`` as that loop read them.

Those checkpoints (tests/data/checkpoint-0.16.1 is one) keep the layout (``layout``: tp, pp, dp, ...) and the
consumed samples at the top of the common state, but no ``args``, no ``content_metadata``, and the RNG states
under the loop's earlier names. megatron.training takes each absence for something else: TP 1 (so a TP2 checkpoint
is "(TP, PP) mismatch after resume"), the deprecated ``dp_zero_gather_scatter`` optimizer sharding (the loop's is
``fully_reshardable``), zero consumed samples (the data would start over), and an RNG state it cannot read (it
exits). ``as_megatron_reads`` fills them in from what the checkpoint does hold; ``patches/earlier_checkpoints.py``
applies it to every common state megatron.training loads. A checkpoint with ``args`` (megatron's own, and the
loop's since it wrote them) is left as it is.
"""

from __future__ import annotations

from types import SimpleNamespace

# the loop's earlier names of the RNG states -> Megatron-LM's
RNG_NAMES = {"random": "random_rng_state", "numpy": "np_rng_state", "torch": "torch_rng_state",
             "device": "cuda_rng_state", "tracker": "rng_tracker_states"}
# how the loop sharded the optimizer state before its checkpoints named it (content_metadata): with it a MoE
# model's two optimizers (dense and expert parameters) save each state under its parameter's key alone
FLOW_OPTIMIZER_FORMAT = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}
# the model sizes megatron.training's check_checkpoint_args reads from a checkpoint's args without a default
_COMPARED = ("num_layers", "hidden_size", "num_attention_heads")


def rng_names(state: dict) -> dict:
    """One rank's RNG states under Megatron-LM's names, whichever the checkpoint used."""
    return {RNG_NAMES.get(name, name): value for name, value in state.items()}


def is_earlier_flow_checkpoint(state) -> bool:
    """A common state the loop wrote before it wrote ``args``: its ``layout`` record without them."""
    return isinstance(state, dict) and "layout" in state and "args" not in state


def as_megatron_reads(state: dict, run_args) -> dict:
    """``state`` (a common or loaded state of such a checkpoint) with ``args`` from its layout and consumed
    samples, the loop's ``content_metadata`` and the RNG states under megatron's names. The model sizes megatron
    compares are the run's (``run_args``): the checkpoint never recorded them, and dist_checkpointing compares
    every tensor's saved global shape with the run's as it loads, which is the check they stand for."""
    layout = state["layout"]
    saved = SimpleNamespace(
        tensor_model_parallel_size=layout["tp"], pipeline_model_parallel_size=layout["pp"],
        data_parallel_size=layout["dp"], world_size=layout["tp"] * layout["pp"] * layout["dp"],
        consumed_train_samples=state.get("consumed_train_samples", 0),
        consumed_valid_samples=state.get("consumed_valid_samples", 0), skipped_train_samples=0,
        **{name: getattr(run_args, name) for name in _COMPARED})
    rng = state.get("rng_state")
    if isinstance(rng, list):
        rng = [rng_names(ranks) if isinstance(ranks, dict) else ranks for ranks in rng]
    return {**state, "args": saved, "content_metadata": state.get("content_metadata") or dict(FLOW_OPTIMIZER_FORMAT),
            **({"rng_state": rng} if rng is not None else {})}


def read_as_megatron_reads(load_base_checkpoint):
    """Wraps megatron.training's ``_load_base_checkpoint`` (state_dict, name, release, type): a state of
    the loop's earlier checkpoints comes back as megatron reads its own."""
    def loaded(*args, **kwargs):
        result = load_base_checkpoint(*args, **kwargs)
        if not is_earlier_flow_checkpoint(result[0]):
            return result
        from megatron.training.global_vars import get_args

        return (as_megatron_reads(result[0], get_args()), *result[1:])

    return loaded

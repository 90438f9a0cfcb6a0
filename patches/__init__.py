"""The adapter's patch table for megatron-core (and Megatron-LM's training loop, ``megatron_lm``): every
change it makes, with the reason for each.

Each submodule registers one concern: ``patches/<concern>.py`` holds the registry entries that install
what ``adapter/<concern>.py`` implements, where the concern has an implementation of its own.
``adapter.registry.status(target)`` tells what became of a patch.
"""

from . import (activation_offload, checkpoint_publish, checkpoint_unpickling, checkpoint_writes, cuda_only_features,
               cuda_routing, dist_checkpointing_devices, distrib_optimizer_checkpoint, early_exit, earlier_checkpoints,
               expert_load, gated_delta_net, gloo_collectives, grad_accumulation, host_offload, input_refusals, kernels,
               latent_attention, liveness, megatron_lm, megatron_lm_recipes, moe, multi_tensor, multi_token_prediction,
               nonfinite, one_rank_groups, parallel, parser_docstrings, recompute, rng, sharding, startup_clock,
               tensorboard_flush, tokenizer_imports, torch_optimizers)

# The megatron-core releases the patch table supports; a patch whose behaviour differs between them says
# so in its reason (README "Supported megatron-core releases").
CHECKED_MEGATRON_CORE = ">=0.16.1,<=0.19.2"
CHECKED_ON = ("0.16.1", "0.17.1", "0.18.2", "0.19.2")


def register_all(registry) -> None:
    registry.check_release(CHECKED_MEGATRON_CORE, CHECKED_ON)
    for concern in (cuda_routing, cuda_only_features, rng, torch_optimizers, distrib_optimizer_checkpoint,
                    dist_checkpointing_devices, checkpoint_writes, checkpoint_unpickling, gloo_collectives,
                    one_rank_groups, host_offload, moe, multi_tensor, parallel, kernels, latent_attention,
                    multi_token_prediction, gated_delta_net, megatron_lm, megatron_lm_recipes, recompute,
                    grad_accumulation, sharding, activation_offload, checkpoint_publish, earlier_checkpoints,
                    liveness, nonfinite, early_exit, startup_clock, expert_load, tensorboard_flush, tokenizer_imports,
                    parser_docstrings,
                    input_refusals):  # last: its validate_args wrap is the outermost, to see every check fail
        concern.register(registry, CHECKED_MEGATRON_CORE)

"""The CUDA sites of megatron that no routing rule answers and no CUDA-only feature owns, each with the
reason it is right off CUDA as written (or the registry patch that answers it). ``adapter.cuda_inventory``
reads these; ``tests/test_cuda_inventory.py`` checks that each entry still matches a site and that each
patch named here is registered.

Keys: ``"module:Qualname spelling"`` (``<module>`` for module-level code); a key without a spelling
covers every site of that function, a key without a qualname every site of that module.
"""

from __future__ import annotations

AS_WRITTEN = {
    "megatron.core.model_parallel_config:ModelParallelConfig 'nccl'":
        "Literal choices and the default of tp_comm_bootstrap_backend, which only bootstraps Transformer "
        "Engine's userbuffers (tp_comm_overlap); a pipeline backend 'nccl' given by the user reaches "
        "parallel_state's new_group, which the strings view routes",
    "megatron.core.parallel_state:initialize_model_parallel 'nccl'":
        "checks the user's pipeline_model_parallel_comm_backend value; the group it names is routed",
    "megatron.core.utils:StragglerDetector.configure 'nccl'":
        "a backend test: with gloo or hccl the detector takes its host-timer branch",
    "megatron.core.transformer.mlp:apply_swiglu_sharded_factory.sh_ten_merge_fn torch.cuda.OutOfMemoryError":
        "an exception class to catch; off CUDA it is never raised and the clause never matches",
    "megatron.core.tensor_parallel.layers:<module> torch.cuda.amp.custom_fwd":
        "fallback for torch < 2.4; with torch >= 2.4 (required) torch.amp.custom_fwd with device_type "
        "'cuda' is taken, which the strings view routes",
    "megatron.core.tensor_parallel.layers:<module> torch.cuda.amp.custom_bwd":
        "fallback for torch < 2.4, as custom_fwd above",
    "megatron.core.extensions.transformer_engine":
        "Transformer Engine's own layers: importable only where TE is installed, which is CUDA only; "
        "megatron's TE specs refuse without it (HAVE_TE)",
    "megatron.core.resharding.refit:<module> 'nccl'":
        "a Literal of refit backend names",
    "megatron.core.resharding.refit:get_or_create_service 'nccl'":
        "selects the NCCL copy service, which sends on torch.distributed's default group (gloo, hccl)",
    "megatron.training.arguments:_add_distributed_args 'nccl'":
        "default and choice of --distributed-backend; the adapter's validate_args patch sets the backend's",
    "megatron.training.arguments:_add_rl_args 'nccl'":
        "a choice of --refit-method; see megatron.core.resharding.refit",
}

# site key -> registry target whose patch answers it (the inventory test checks it is registered)
PATCHED = {
    "megatron.core.dist_checkpointing.exchange_utils:_get_empty_tensor_for_exchange 'cuda'":
        "megatron.core.dist_checkpointing.mapping:ShardedTensor.init_data",
}


def _lookup(table: dict, module: str, qualname: str, spelling: str):
    for key in (f"{module}:{qualname} {spelling}", f"{module}:{qualname}", module):
        if key in table:
            return key, table[key]
    return None, None


def as_written(module: str, qualname: str, spelling: str) -> tuple[str | None, str]:
    """(key, reason) of the entry covering this site, or (None, "")."""
    key, reason = _lookup(AS_WRITTEN, module, qualname, spelling)
    return key, reason or ""


def patched(module: str, qualname: str, spelling: str) -> tuple[str | None, str]:
    """(key, registry target) of the entry covering this site, or (None, "")."""
    key, target = _lookup(PATCHED, module, qualname, spelling)
    return key, target or ""

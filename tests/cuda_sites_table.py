"""The CUDA sites of megatron that no routing rule answers and no CUDA-only feature owns, each with the
reason it is right off CUDA as written (or the registry patch that answers it). ``tests.cuda_inventory``
reads these; ``tests/test_cuda_inventory.py`` checks that each entry still matches a site and that each
patch named here is registered.

Keys: ``"module:Qualname spelling"`` (``<module>`` for module-level code); a key without a spelling
covers every site of that function, a key without a qualname every site of that module.

megatron-core moves and adds CUDA sites between releases; ``RELEASES`` says which supported releases have
the site of an entry (of these tables, or of a feature's ``code`` in ``adapter.cuda_only_features``) that
not all of them have, so an entry is checked on the releases that have its site and is not stale on the
others.
"""

from __future__ import annotations

from packaging.specifiers import SpecifierSet
from packaging.version import Version

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
    "megatron.core.transformer.utils:cat_with_oom_fallback torch.cuda.OutOfMemoryError":
        "the merge of mlp's sh_ten_merge_fn, moved here: an exception class to catch, never raised off CUDA",
    "megatron.core.transformer.transformer_config:TransformerConfig 'nccl'":
        "a Literal choice of inference_moe_token_dispatcher_type, an inference all-gather strategy, not a "
        "torch.distributed backend",
    "megatron.core.dist_checkpointing.strategies.filesystem_async:"
    "FileSystemWriterAsync.prepare_write_data._clone_or_dequantize_if_needed 'cuda'":
        "a device-type test for Transformer Engine's quantized tensors, which exist only on CUDA: off CUDA it "
        "answers False and the tensor is written as it is",
    "megatron.core.tensor_parallel.layers:<module> torch.cuda.amp.custom_fwd":
        "fallback for torch < 2.4; with torch >= 2.4 (required) torch.amp.custom_fwd with device_type "
        "'cuda' is taken, which the strings view routes",
    "megatron.core.tensor_parallel.layers:<module> torch.cuda.amp.custom_bwd":
        "fallback for torch < 2.4, as custom_fwd above",
    "megatron.core.extensions.transformer_engine":
        "Transformer Engine's own layers: importable only where TE is installed, which is CUDA only; "
        "megatron's TE specs refuse without it (HAVE_TE)",
    "megatron.core.pipeline_parallel.fine_grained_activation_offload:OffloadTensorPool.__init__ 'cuda'":
        "the pool's default device; megatron's offload manager builds its one pool on 'cpu', and a pool left at "
        "the default allocates through torch.empty(device=...), which the strings view routes",
    "megatron.core.resharding.refit:<module> 'nccl'":
        "a Literal of refit backend names",
    "megatron.core.resharding.refit:get_or_create_service 'nccl'":
        "selects the NCCL copy service, which sends on torch.distributed's default group (gloo, hccl)",
    "megatron.training.arguments:_add_distributed_args 'nccl'":
        "default and choice of --distributed-backend; the adapter's validate_args patch sets the backend's",
    "megatron.training.config.common_config:DistributedInitConfig 'nccl'":
        "default and Literal choice of distributed_backend, --distributed-backend's config form; the "
        "adapter's validate_args patch sets the backend's, and a group it names is routed",
    "megatron.training.gpu_sniff_test:main":
        "the standalone entry point of a GPU benchmark (torchrun megatron/training/gpu_sniff_test.py), run by "
        "hand on a GPU machine; training reaches only run_gpu_sniff_test, whose sites are routed",
    "megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer:"
    "ParamAndGradBuffer._init_each_parameter_group_buffers 'cuda'":
        "a device-type test counting parameters for a log line; off CUDA they count as host parameters",
    "megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer:check_gpu_memory":
        "after torch.cuda.is_available() (the device layer's): on cpu it answers False and nothing else runs",
    "megatron.training.arguments:_add_rl_args 'nccl'":
        "a choice of --refit-method; see megatron.core.resharding.refit",
}

# site key -> registry target whose patch answers it (the inventory test checks it is registered)
PATCHED = {
    "megatron.core.distributed.fsdp.mcore_fsdp_adapter:FullyShardedDataParallel._init_dist_index 'cuda'":
        "megatron.core.distributed.fsdp.mcore_fsdp_adapter:DeviceMesh",
    "megatron.core.transformer.fsdp_dtensor_checkpoint:validate_loaded_state_dict 'cuda'":
        "megatron.core.transformer.fsdp_dtensor_checkpoint:DeviceMesh",
    "megatron.core.distributed.torch_fully_sharded_data_parallel:TorchFullyShardedDataParallel.__init__ 'cuda'":
        "megatron.core.distributed.torch_fully_sharded_data_parallel:DeviceMesh",
    "megatron.core.dist_checkpointing.exchange_utils:_get_empty_tensor_for_exchange 'cuda'":
        "megatron.core.dist_checkpointing.mapping:ShardedTensor.init_data",
    # megatron.training.utils became a package in 0.18; the patch rebinds every copy of the function
    "megatron.training.utils.common_utils:get_device_arch_version":
        "megatron.training.utils:get_device_arch_version",
}


# entry -> the supported releases that have its site, where not all do (PEP 440, megatron-core's version)
RELEASES = {
    "megatron.core.transformer.mlp:apply_swiglu_sharded_factory.sh_ten_merge_fn torch.cuda.OutOfMemoryError":
        "<0.18",
    "megatron.core.transformer.utils:cat_with_oom_fallback torch.cuda.OutOfMemoryError": ">=0.18",
    "megatron.core.transformer.transformer_config:TransformerConfig 'nccl'": ">=0.18",
    "megatron.core.dist_checkpointing.strategies.filesystem_async:"
    "FileSystemWriterAsync.prepare_write_data._clone_or_dequantize_if_needed 'cuda'": ">=0.17",
    "megatron.training.arguments:_add_distributed_args 'nccl'": "<0.17",
    "megatron.training.config.common_config:DistributedInitConfig 'nccl'": ">=0.17",
    "megatron.training.gpu_sniff_test:main": ">=0.18",
    "megatron.training.utils.common_utils:get_device_arch_version": ">=0.18",
    # features' code (adapter.cuda_only_features)
    "megatron.core.utils:GlobalSymmetricMemoryBuffer": "<0.17",
    "megatron.core.inference.symmetric_memory:SymmetricMemoryBuffer": ">=0.17",
    "megatron.core.tensor_parallel.inference_layers": "<0.17",
    "megatron.core.inference.communication.torch_symm_triton": ">=0.17",
    "megatron.core.inference.moe": ">=0.18",
    "megatron.core.optimizer.optimizer_cuda_graph": ">=0.17",
    "megatron.core.resharding.copy_services.nixl_copy_service": ">=0.19",
    "megatron.core.inference.utils:device_memory_summary": ">=0.17",
    "megatron.training.utils.utils:start_memory_history_recording": ">=0.19",
}


def on_release(entry: str, release: str) -> bool:
    """Whether megatron-core ``release`` has the site(s) of ``entry``: where it has, an entry that matches
    nothing is stale; where it has not, the entry is another release's."""
    spec = RELEASES.get(entry)
    return spec is None or Version(release) in SpecifierSet(spec)


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

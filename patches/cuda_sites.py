"""Megatron modules whose own ``torch.cuda`` calls go to the adapter's device layer on cpu and npu.

Each entry rebinds the module's global ``torch`` to a view (adapter.torch_view) in which ``torch.cuda``
is ``adapter.device``; modules that also write ``device="cuda"`` get the view that routes factory
device arguments too. On cuda nothing is installed: megatron runs as written.
"""

from adapter import torch_view

OFF_CUDA = ("cpu", "npu")
_CORE = "megatron.core."

# module -> why its torch.cuda calls must follow the backend
ROUTED = {
    "tensor_parallel.random": "the model-parallel RNG tracker seeds and reads the CUDA generator",
    "tensor_parallel.layers": "linear layers allocate weights and buffers on current_device()",
    "tensor_parallel.mappings": "gather/scatter outputs are allocated on current_device()",
    "tensor_parallel.data": "broadcast_data allocates on current_device()",
    "tensor_parallel.utils": "split/gather helpers allocate on current_device()",
    "models.common.embeddings.rotary_pos_embedding": "RoPE frequencies move to current_device()",
    "models.gpt.gpt_model": "GPTModel allocates position/MTP buffers on current_device()",
    "transformer.module": "fp16/bf16 conversion allocates on current_device()",
    "transformer.attention": "attention allocates KV buffers on current_device()",
    "transformer.dot_product_attention": "attention workspace on current_device()",
    "transformer.transformer_layer": "layer buffers on current_device()",
    "transformer.mlp": "MLP catches torch.cuda.OutOfMemoryError and empties the CUDA cache",
    "pipeline_parallel.p2p_communication": "p2p receive buffers on current_device(), torch.cuda.synchronize",
    "distributed.param_and_grad_buffer": "DDP param/grad buffers on current_device(), CUDA streams",
    "distributed.distributed_data_parallel": "DDP communication streams and synchronize",
    "optimizer.distrib_optimizer": "distributed optimizer buffers on current_device()",
    "dist_checkpointing.strategies.filesystem_async": "async writer calls torch.cuda.synchronize",
    "dist_checkpointing.strategies.async_utils": "async save calls synchronize/current_device",
    "dist_checkpointing.strategies.fully_parallel": "fully parallel save calls torch.cuda.synchronize",
    "timers": "timers synchronize the device around each measurement",
}

# module -> why, for modules that also write device="cuda" (or torch.autocast("cuda"))
ROUTED_WITH_DEVICE_STRINGS = {
    "utils": "GlobalMemoryBuffer on current_device(); l2-norm and packed-seq tensors on device='cuda'",
    "transformer.utils": "default causal masks are built on device='cuda'",
    "pipeline_parallel.schedules": "every schedule counts tokens in torch.zeros(device='cuda')",
    "optimizer.optimizer": "found_inf and loss-scale tensors are created on device='cuda'",
    "optimizer.clip_grads": "grad-norm buffers are created on device='cuda'",
    "dist_checkpointing.strategies.state_dict_saver": "save verification tensors on device='cuda'",
    "rerun_state_machine": "the rerun state machine makes device='cuda' tensors every step",
}


def register(registry, versions: str) -> None:
    for table, view in ((ROUTED, torch_view.routed()),
                        (ROUTED_WITH_DEVICE_STRINGS, torch_view.routed_strings())):
        for module, why in table.items():
            registry.replace(f"{_CORE}{module}:torch", view, reason=why, versions=versions,
                             backends=OFF_CUDA, rebind_copies=False)

"""Megatron functions that spell CUDA inside tensor methods (t.type(), t.cuda()), out of a module view's reach."""

from adapter.torch_view import cuda_spelled_tensor_calls

# target -> why; each runs under adapter.torch_view.cuda_spelled_tensor_calls on cpu and npu
CUDA_SPELLED = {
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.__init__":
        "dispatches on param.type() == 'torch.cuda.FloatTensor' (else TypeError)",
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.get_parameter_state_dp_zero":
        "gathers optimizer state for saving through send_tensor.cuda()",
    "megatron.core.optimizer.optimizer:Float16OptimizerWithFloat16Params.__init__":
        "dispatches on param.type() == 'torch.cuda.*Tensor' (else TypeError)",
    "megatron.core.optimizer.clip_grads:clip_grad_by_total_norm_fp32":
        "asserts grad.type() == 'torch.cuda.FloatTensor'",
    "megatron.core.models.common.language_module.language_module:"
    "LanguageModule.setup_embeddings_and_output_layer":
        "moves the tied embedding weight with .cuda() before its all-reduce",
    "megatron.core.tensor_parallel.data:broadcast_data":
        "moves batch tensors with .cuda() before the TP broadcast",
}


def register(registry, versions: str) -> None:
    for target, why in CUDA_SPELLED.items():
        registry.wrap(target, cuda_spelled_tensor_calls, reason=why, versions=versions,
                      backends=("cpu", "npu"))

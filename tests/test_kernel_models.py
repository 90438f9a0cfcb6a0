"""The tiny GPT with fusion flags on, through megatron's own ``get_gpt_layer_local_spec``: the kernel
provider's modules and kernels are what it gets, and its loss and gradients are megatron's local ones."""

import pytest

from tests.conftest import DOUBLES
from tests.distributed import run_ranks
from tests.kernel_models import compare_with_megatron_local, moe_losses
from tests.triton_interpreter import liger_unavailable

pytestmark = pytest.mark.multiproc

ALL_FUSIONS = dict(apply_rope_fusion=True, bias_activation_fusion=True, masked_softmax_fusion=True,
                   cross_entropy_loss_fusion=True)

PROVIDERS = {
    "torch": ({"ADAPTER_KERNELS": "torch"}, ALL_FUSIONS, ["TorchNorm", "TorchCoreAttention"]),
    "npu": ({"ADAPTER_KERNELS": "npu", "PYTHONPATH": str(DOUBLES)}, ALL_FUSIONS,
            ["NpuNorm", "NpuCoreAttention"]),
}
# The cuda provider under each ADAPTER_CUDA_FUSED choice; without Transformer Engine it answers every flag
# (RoPE and cross entropy included). Liger's Triton kernels run interpreted (tests/triton_interpreter.py).
# Its ranks use CPU tensors, so Triton interprets there even on a GPU machine.
for _choice in ("eager", "compile", "liger"):
    PROVIDERS[f"cuda-{_choice}"] = ({"ADAPTER_KERNELS": "cuda", "ADAPTER_CUDA_FUSED": _choice,
                                     **({"TRITON_INTERPRET": "1"} if _choice == "liger" else {})}, ALL_FUSIONS,
                                    ["CudaNorm", "CudaCoreAttention"])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PROVIDERS))
def test_tiny_gpt_through_the_local_spec_matches_megatron_local_modules(name):
    env, fusions, (norm, attention) = PROVIDERS[name]
    if name == "cuda-liger" and liger_unavailable():
        pytest.skip(liger_unavailable())
    result = run_ranks(1, compare_with_megatron_local, fusions, env={"ADAPTER_BACKEND": "cpu", **env})[0]
    assert (result["provider"], result["fused"]) == (name.split("-")[0], env.get("ADAPTER_CUDA_FUSED"))
    assert result["modules"] == [norm, norm, attention, norm]
    assert result["grad_names"]
    assert result["loss"] == pytest.approx(result["reference_loss"], abs=1e-5)
    assert result["max_grad_diff"] < 1e-5
    if name == "npu":
        calls = result["npu_calls"]
        # fp32: the fused softmax (fp16/bf16 only) stays out; every other op went through torch_npu
        for op in ("npu_rms_norm", "npu_swiglu", "npu_rotary_mul", "npu_fusion_attention",
                   "npu_cross_entropy_loss"):
            assert calls.get(op, 0) > 0, f"torch_npu.{op} was not called: {calls}"
        # flags off: the spec's modules still use torch_npu, the flag-gated functions do not
        assert sorted(result["npu_calls_flags_off"]) == ["npu_fusion_attention", "npu_rms_norm"]


def test_vocab_parallel_cross_entropy_matches_megatron_across_two_ranks():
    """The split-vocabulary path (torch provider, and npu above TP 1): one MAX and one SUM all-reduce."""
    from tests.kernel_models import cross_entropy_across_tensor_parallel_ranks

    assert max(run_ranks(2, cross_entropy_across_tensor_parallel_ranks)) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_the_npu_providers_moe_kernels_run_and_give_the_torch_providers_losses(dispatcher):
    """moe_grouped_gemm and moe_permute_fusion on: the npu provider (the torch_npu double) really calls
    torch_npu's grouped matmul and permutation (at EP1 every token keeps its k experts in either
    dispatcher's map) and trains to the torch provider's losses."""
    runs = {name: run_ranks(1, moe_losses, dispatcher, env={"ADAPTER_BACKEND": "cpu", **PROVIDERS[name][0]})[0]
            for name in ("torch", "npu")}
    assert runs["npu"]["experts"] == ["TEGroupedMLP", "NpuColumnParallelGroupedLinear"]
    assert runs["npu"]["losses"] == pytest.approx(runs["torch"]["losses"], abs=1e-5)
    calls = runs["npu"]["npu_calls"]
    for op in ("npu_grouped_matmul", "npu_moe_token_permute", "npu_moe_token_unpermute"):
        assert calls.get(op, 0) > 0, f"torch_npu.{op} was not called: {calls}"

"""CUDA-only features are refused off CUDA where they are configured: one line naming the setting, before
megatron's own code (which would fail deep inside with "Torch not compiled with CUDA enabled")."""

import types

import pytest
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.transformer.transformer_config import TransformerConfig

import adapter  # noqa: F401 - applies the refusals
from adapter.cuda_only_features import FEATURES, CudaOnlyFeatureError
from patches.cuda_only_features import refuse_configured, refuse_nvshmem_refit

TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4)
TRANSFORMER = [("enable_cuda_graph", True), ("external_cuda_graph", True), ("cuda_graph_impl", "local"),
               ("fp8", "hybrid"), ("fp4", "e2m1"), ("batch_invariant_mode", True),
               ("symmetric_ar_type", "two_shot"),
               ("use_inference_optimized_layers", True), ("tp_comm_overlap", True),
               ("moe_token_dispatcher_type", "flex")]
DDP = [("nccl_ub", True)]  # Megatron-FSDP and torch FSDP2 run off CUDA: tests/test_sharding.py
ARGS_ONLY = [("refit_method", "nvshmem"), ("record_memory_history", True),
             ("profile", True), ("optimizer_cuda_graph", True)]


def _refused(call, setting, value):
    with pytest.raises(CudaOnlyFeatureError) as refused:
        call()
    message = str(refused.value)
    assert message.startswith(f"{setting}={value!r}: ") and "\n" not in message
    assert "runs only on CUDA" in message and "cpu backend" in message


def test_every_setting_of_the_table_is_tested_here():
    settings = {s for f in FEATURES for s in f.settings}
    assert settings == {s for s, _ in TRANSFORMER + DDP + ARGS_ONLY}


@pytest.mark.parametrize("setting, value", TRANSFORMER)
def test_transformer_config_refuses(setting, value):
    _refused(lambda: TransformerConfig(**TINY, **{setting: value}), setting, value)


@pytest.mark.parametrize("setting, value", DDP)
def test_ddp_config_refuses(setting, value):
    _refused(lambda: DistributedDataParallelConfig(**{setting: value}), setting, value)


@pytest.mark.parametrize("setting, value", TRANSFORMER + DDP + ARGS_ONLY)
def test_megatron_lm_arguments_are_refused_before_validate_args_runs(setting, value):
    ran = []
    validate = refuse_configured(ran.append)
    _refused(lambda: validate(types.SimpleNamespace(**{setting: value})), setting, value)
    assert ran == []


def test_defaults_and_the_ways_that_run_off_cuda_are_not_refused():
    TransformerConfig(**TINY, cuda_graph_impl="none")
    DistributedDataParallelConfig(use_distributed_optimizer=True)
    DistributedDataParallelConfig(use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params")
    validate = refuse_configured(lambda args: "validated")
    args = types.SimpleNamespace(profile=True, use_pytorch_profiler=True, refit_method="gloo", fp8=None)
    assert validate(args) == "validated"


def test_the_classes_that_are_the_feature_refuse_construction():
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext

    with pytest.raises(CudaOnlyFeatureError, match=r"^DynamicInferenceContext\(\.\.\.\): the dynamic inference"):
        DynamicInferenceContext(None)


def test_nvshmem_refit_is_refused_and_gloo_passes():
    service = refuse_nvshmem_refit(lambda backend: f"service for {backend}")
    assert service("gloo") == "service for gloo"
    with pytest.raises(CudaOnlyFeatureError, match=r"^refit backend 'nvshmem': NVSHMEM weight refit"):
        service("nvshmem")
    with pytest.raises(CudaOnlyFeatureError, match=r"^refit backend 'nixl': NIXL weight refit"):  # 0.19's
        service("nixl")


def test_optimizer_cuda_graphs_are_refused_where_the_optimizer_config_has_them():
    """``OptimizerConfig.optimizer_cuda_graph`` arrived in 0.17 (0.16.1's config has no such field)."""
    import dataclasses

    from megatron.core.optimizer import OptimizerConfig

    if "optimizer_cuda_graph" not in {f.name for f in dataclasses.fields(OptimizerConfig)}:
        pytest.skip("this megatron-core's OptimizerConfig has no optimizer_cuda_graph")
    _refused(lambda: OptimizerConfig(optimizer_cuda_graph=True), "optimizer_cuda_graph", True)
    OptimizerConfig()

"""Rank function of the flow's offloading tests (tests/test_flow_offload.py): scripts/pretrain_gpt.py's
``pretrain`` (megatron.training's, tests/flow_ranks.py's ``run_pretrain``), reporting besides what was logged where the
optimizer's state lives (tests/offload_ranks.py's ``state_bytes``), whether megatron built its
HybridDeviceOptimizer, and the bytes megatron's activation offload manager offloaded."""

from __future__ import annotations

import adapter  # noqa: F401 - before megatron
from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer
from megatron.core.pipeline_parallel.fine_grained_activation_offload import PipelineOffloadManager

from tests.offload_ranks import state_bytes
from tests.flow_ranks import run_pretrain_keeping_setup


def run_pretrain_offloading(argv: list[str]) -> dict:
    history, (_, optimizer, _) = run_pretrain_keeping_setup(argv)
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    manager = PipelineOffloadManager.get_instance() if "--fine-grained-activation-offloading" in argv else None
    return {**history, **state_bytes(optimizer),
            "hybrid": all(isinstance(opt.optimizer, HybridDeviceOptimizer) for opt in inner),
            "offloaded_bytes": manager.offload_summary_total_bytes if manager is not None else 0}

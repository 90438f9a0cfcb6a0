"""Mixture-of-Experts on every backend (issue 15): what megatron-core's MoE code needs beyond CUDA.

``moe_utils`` imports ``te_general_gemm`` with Transformer Engine's fused MoE ops inside ``try: ...``; its
``except ImportError`` branch never binds the name, although ``RouterGatingLinearFunction`` (every
router's gating GEMM) asks ``te_general_gemm is not None`` before falling back to ``torch.mm``. Without
TE (CPU, Ascend, CUDA without TE) every MoE router raises ``NameError``; bound to None, it takes the
fallback megatron wrote for that case.
"""

_MOE_UTILS = "megatron.core.transformer.moe.moe_utils"


def register(registry, versions: str) -> None:
    registry.bind(f"{_MOE_UTILS}:te_general_gemm", None, versions=versions,
                  reason="unbound without Transformer Engine; the router's gating GEMM falls back to torch.mm on None")

"""Selective recompute without Transformer Engine (issue 43): megatron's output-discarding checkpoint.

``tensor_parallel.CheckpointWithoutOutput`` (the ``layernorm``, ``moe_act``, ``mla_up_proj`` modules of
``--recompute-modules``) sets ``self.fp8 = fp8 is not None``, so its default ``fp8=False`` reads as "ask TE's
FP8 state", and its forward and recompute call ``FP8GlobalStateManager`` and ``activation_recompute_forward``,
names bound only when Transformer Engine imports: every such recompute raises ``NameError`` without TE (CPU,
Ascend, CUDA without TE). FP8 cannot be on without TE, so there the object answers "fp8 not enabled", the
branch megatron takes for ``fp8=None``: the same forward and recompute, with null contexts.
"""

_RANDOM = "megatron.core.tensor_parallel.random"


def _no_fp8_without_te(init):
    """``CheckpointWithoutOutput.__init__`` leaving ``fp8`` off where megatron found no Transformer Engine."""

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        from megatron.core.tensor_parallel import random

        if not random.HAVE_TE:
            self.fp8 = False

    return __init__


def register(registry, versions: str) -> None:
    registry.wrap(f"{_RANDOM}:CheckpointWithoutOutput.__init__", _no_fp8_without_te, versions=versions,
                  reason="fp8=False reads as 'ask TE's FP8 state', whose names are unbound without TE: fp8 off")

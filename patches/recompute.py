"""Selective recompute without Transformer Engine (issue 43): megatron's output-discarding checkpoint.

``tensor_parallel.CheckpointWithoutOutput`` (the ``layernorm``, ``moe_act``, ``mla_up_proj`` modules of
``--recompute-modules``) sets ``self.fp8 = fp8 is not None``, so its default ``fp8=False`` reads as "ask TE's
FP8 state", and its forward and recompute call ``FP8GlobalStateManager`` and ``activation_recompute_forward``,
names bound only when Transformer Engine imports: every such recompute raises ``NameError`` without TE (CPU,
Ascend, CUDA without TE). FP8 cannot be on without TE, so there the object answers "fp8 not enabled", the
branch megatron takes for ``fp8=None``: the same forward and recompute, with null contexts.

From 0.19 the recomputed outputs are put back into the discarded storages by a C++ extension that
``_get_share_storage`` builds with ``load_inline`` at the first recompute (the host's compiler and ninja:
155 s for the first iteration on the 2-core guest, 7 s without). Off CUDA the recomputed output is copied into
the discarded storage instead, as megatron-core <= 0.18 did: the same values, one output-sized copy.
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


def _copy_storage(dst, src) -> None:
    """Refills the storage ``discard_output_and_register_recompute`` emptied with the recomputed output, below
    the tensor (no version-counter bump; every view of the storage sees it)."""
    dst.untyped_storage().resize_(src.untyped_storage().nbytes())
    dst.untyped_storage().copy_(src.untyped_storage())


def _storage_copy():
    """``_get_share_storage()``'s answer off CUDA: the copy, with nothing to compile."""
    return _copy_storage


def register(registry, versions: str) -> None:
    registry.wrap(f"{_RANDOM}:CheckpointWithoutOutput.__init__", _no_fp8_without_te, versions=versions,
                  reason="fp8=False reads as 'ask TE's FP8 state', whose names are unbound without TE: fp8 off")
    registry.replace(f"{_RANDOM}:_get_share_storage", _storage_copy, versions=versions, backends=("cpu", "npu"),
                     optional=True, reason="0.19+: builds a C++ extension at the first recompute (a compiler, minutes)")

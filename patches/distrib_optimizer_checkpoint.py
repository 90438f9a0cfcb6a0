"""megatron-core's resharding checkpoint format for the distributed optimizer (0.16.1 to 0.19.2 alike).

``sharded_param_state_fully_reshardable`` cuts each parameter's optimizer state out of the gathered
state with the parameter's offsets in the gradient buffer, which pads every bucket to a multiple of the
data-parallel size; but ``get_parameter_state_dp_zero`` gathers the buckets back to back with that
padding removed. With more than one bucket, every parameter after the first bucket's padding receives a
neighbour's Adam moments and master weights (and past the end, zeros with a warning): a resumed run
silently diverges. The wrapper hands the format the gathered state laid out as the buffer is, padding
re-inserted, so the offsets point at the right elements. Loading does not use those offsets.

0.18 reworked the gradient buffers: ``param_index_map`` and the bucket ranges now come from a precomputed
``param_layout``. The fault and the fix carry over unchanged to 0.19.2. The map and ``bucket.offset`` are both
offsets in the padded buffer, ``get_parameter_state_dp_zero`` still joins the unpadded buckets end to end, and
``sharded_param_state_fully_reshardable`` differs from 0.16.1 in comments only. The saved format is the same on
every release, so a checkpoint from 0.16.1 loads under 0.19.2 (tests/test_checkpoint_upgrade.py).
"""

from __future__ import annotations

import functools

import torch

_DISTRIB = "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer"


def _padded_like_buffers(optimizer, gathered: dict) -> dict:
    """``gathered`` (per buffer and dtype: state -> bucket-concatenated 1-D tensors) re-laid with each
    bucket at its offset in the buffer."""
    for gbuf_idx, per_dtype in gathered.items():
        if not isinstance(gbuf_idx, int):
            continue
        buffer = optimizer.buffers[gbuf_idx]
        for dtype, tensors in per_dtype.items():
            for key, packed in list(tensors.items()):
                if not torch.is_tensor(packed) or packed.dim() != 1:
                    continue
                laid_out = torch.zeros(buffer.numel, dtype=packed.dtype, device=packed.device)
                start = 0
                for bucket in buffer.buckets:
                    laid_out[bucket.offset:bucket.offset + bucket.numel_unpadded] = \
                        packed[start:start + bucket.numel_unpadded]
                    start += bucket.numel_unpadded
                tensors[key] = laid_out
    return gathered


def state_at_buffer_offsets(sharded_param_state):
    """Registry wrapper for ``DistributedOptimizer.sharded_param_state_fully_reshardable``."""

    @functools.wraps(sharded_param_state)
    def sharded_param_state_fully_reshardable(self, *args, **kwargs):
        gather = type(self).get_parameter_state_dp_zero

        def gathered_at_buffer_offsets(*g_args, **g_kwargs):
            state = gather(self, *g_args, **g_kwargs)
            return None if state is None else _padded_like_buffers(self, state)

        self.get_parameter_state_dp_zero = gathered_at_buffer_offsets  # this call only
        try:
            return sharded_param_state(self, *args, **kwargs)
        finally:
            del self.get_parameter_state_dp_zero

    return sharded_param_state_fully_reshardable


def register(registry, versions: str) -> None:
    registry.wrap(f"{_DISTRIB}.sharded_param_state_fully_reshardable", state_at_buffer_offsets,
                  versions=versions,
                  reason="fully_reshardable reads unpadded gathered state at padded buffer offsets "
                         "(several buckets: parameters get their neighbours' optimizer state)")

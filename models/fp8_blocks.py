"""FP8 weights with block scales, as DeepSeek-V3's published checkpoint stores them, read as bf16.

Each FP8 (e4m3) ``<name>.weight`` comes with ``<name>.weight_scale_inv``: one float32 per block of
``block`` rows x ``block`` columns (config.json's ``quantization_config.weight_block_size``, 128 x 128;
the last blocks of a side not a multiple of 128 are partial). The weight is ``fp8 value x scale_inv`` of
its block (DeepSeek's own ``weight_dequant`` and transformers' FP8 integration compute exactly this), computed
in float32 and rounded once to bf16. Rows are dequantized a block of rows at a time, so a converter streaming
a tensor in row ranges reads only the scale rows of those ranges.
"""

from __future__ import annotations

from typing import Callable

import torch

SCALE_SUFFIX = "_scale_inv"
DEFAULT_BLOCK = 128


def block_size(config: dict) -> int:
    """The square block of config.json's ``quantization_config`` (128 where it does not say)."""
    quantization = config.get("quantization_config") or {}
    size = quantization.get("weight_block_size") or [DEFAULT_BLOCK, DEFAULT_BLOCK]
    if len(size) != 2 or size[0] != size[1]:
        raise ValueError(f"quantization_config.weight_block_size={size}: only square blocks (e.g. [128, 128]) "
                         "are supported")
    return int(size[0])


def scale_shape(shape: tuple, block: int) -> tuple[int, int]:
    """The ``weight_scale_inv`` shape of a 2-D FP8 weight of ``shape``."""
    return -(-shape[0] // block), -(-shape[1] // block)


def dequantize_rows(read: Callable[[int, int], torch.Tensor], read_scale: Callable[[int, int], torch.Tensor],
                    start: int, stop: int, block: int) -> torch.Tensor:
    """Rows [start, stop) of an FP8 weight as bf16: ``read(a, b)`` gives its FP8 rows, ``read_scale(a, b)``
    its scale rows."""
    values = read(start, stop).float()
    first, last = start // block, (stop - 1) // block + 1
    scales = read_scale(first, last).float()
    scales = scales.repeat_interleave(block, dim=0)[start - first * block:stop - first * block]
    scales = scales.repeat_interleave(block, dim=1)[:, :values.shape[1]]
    return (values * scales).to(torch.bfloat16)

"""The reasoned tables behind ``adapter.cuda_inventory``: CUDA sites of megatron that the routing rule does
not answer, and why each is right off CUDA anyway."""

from __future__ import annotations


def refused_feature(module: str, qualname: str) -> str:
    return ""


def patched(module: str, qualname: str) -> str:
    return ""


def as_written(module: str, qualname: str, spelling: str) -> str:
    return ""

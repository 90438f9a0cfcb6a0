"""Shared fixtures."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

DOUBLES = Path(__file__).resolve().parent / "doubles"


def _drop_torch_npu_modules() -> None:
    for name in [n for n in sys.modules if n == "torch_npu" or n.startswith("torch_npu.")]:
        del sys.modules[name]


@pytest.fixture
def torch_npu_double(monkeypatch):
    """The pure-PyTorch torch_npu double (tests/doubles), importable for this test only.

    Yields the imported module; afterwards sys.path is restored and every torch_npu module is dropped
    from sys.modules, so later tests see this machine as it is (no torch_npu)."""
    _drop_torch_npu_modules()
    monkeypatch.syspath_prepend(str(DOUBLES))
    import torch_npu

    assert getattr(torch_npu, "IS_DOUBLE", False), f"a real torch_npu shadows the double: {torch_npu}"
    try:
        yield torch_npu
    finally:
        _drop_torch_npu_modules()


@pytest.fixture
def npu_kernels(torch_npu_double):
    """The npu kernel provider module, imported against the double (and forgotten afterwards)."""
    sys.modules.pop("adapter.kernels.npu_provider", None)
    torch_npu_double.CALLS.clear()
    yield importlib.import_module("adapter.kernels.npu_provider")
    sys.modules.pop("adapter.kernels.npu_provider", None)


@pytest.fixture(params=["torch", "cuda", "npu"])
def provider(request):
    """Each kernel provider in turn; the npu one runs against the torch_npu double."""
    from adapter import kernels

    if request.param == "npu":
        return request.getfixturevalue("npu_kernels")
    return kernels.select_provider(request.param)

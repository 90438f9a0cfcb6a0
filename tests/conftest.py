"""Shared fixtures, and the device markers' skips (markers are registered in pytest.ini)."""

from __future__ import annotations

import collections
import contextlib
import functools
import glob
import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

# Triton kernels (Liger-Kernel's) run on this suite's CPU tensors through Triton's interpreter, which Triton
# picks when it is imported, and ``import adapter`` imports it: set before anything does, on a machine
# without an NVIDIA GPU (with one, the same tests compile the kernels for it; tests/triton_interpreter.py).
if not glob.glob("/dev/nvidia[0-9]*"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

DOUBLES = Path(__file__).resolve().parent / "doubles"


def _cuda_missing() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA device (torch.cuda.is_available() is False)"
    return None


def _npu_missing() -> str | None:
    """A real torch_npu and an NPU (the tests' torch_npu double is on sys.path only inside its fixture).

    Asked in a fresh interpreter: importing torch_npu here would put a real torch_npu into the whole test
    session, and the tests against the double need a session without one."""
    if importlib.util.find_spec("torch_npu") is None:
        return "needs an Ascend NPU (torch_npu is not installed)"
    probe = subprocess.run([sys.executable, "-c", "import torch, torch_npu; print(torch.npu.is_available())"],
                           capture_output=True, text=True, timeout=300)
    if probe.returncode != 0:  # torch_npu raises RuntimeError, not ImportError, when CANN is missing
        last = (probe.stderr.strip().splitlines() or ["no error output"])[-1]
        return f"needs an Ascend NPU (import torch_npu failed: {last})"
    if probe.stdout.strip() != "True":
        return "needs an Ascend NPU (torch.npu.is_available() is False)"
    return None


def _megatron_lm_missing() -> str | None:
    """Megatron-LM's own code (pretrain_gpt.py, its megatron.training) from a checkout: from 0.17 the
    megatron-core wheel ships a megatron.training too, but not the scripts these tests run."""
    from adapter.core_source import megatron_lm_checkout

    if megatron_lm_checkout() is None:
        return ("needs a Megatron-LM checkout on PYTHONPATH (its megatron.training and pretrain_gpt.py; the tag "
                "matching the installed megatron-core, e.g. core_v0.16.1)")
    return None


def _megatron_training_missing() -> str | None:
    """megatron.training, which scripts/pretrain_gpt.py runs: in the megatron-core wheel from 0.17, from a
    Megatron-LM checkout on 0.16.1."""
    if importlib.util.find_spec("megatron.training") is None:
        return ("needs megatron.training (megatron-core 0.17 or later, or on 0.16.1 a Megatron-LM checkout at "
                "core_v0.16.1 on PYTHONPATH)")
    return None


# marker -> why its tests cannot run here (None: they can); asked once per session, and only when a
# collected test carries the marker.
REQUIREMENTS = {"cuda": _cuda_missing, "npu": _npu_missing, "megatron_lm": _megatron_lm_missing,
                "megatron_training": _megatron_training_missing}


# what a test module's code names when it runs the flow: an import of megatron.training, of the flow's package
# or of the in-process harness, or the script's path as a string
_RUNS_THE_FLOW = re.compile(r"^\s*(from|import) (megatron\.training|flow\b|tests\.flow_ranks)|^\s*from tests import .*"
                            r"\bflow_ranks\b|[\"']scripts/pretrain_gpt\.py[\"']", re.MULTILINE)


_TESTS_IMPORT = re.compile(r"^\s*from tests(?:\.(\w+))? import ([\w, ]+)", re.MULTILINE)


@functools.cache
def runs_the_flow(path: Path) -> bool:
    """Whether the test module at ``path`` runs megatron.training (by the rule of ``_RUNS_THE_FLOW``, in it or in
    a module of tests/ it imports): its tests are ``megatron_training`` tests, and where megatron.training is
    missing (0.16.1 without a checkout) the module is skipped whole, before an import of it fails."""
    source = path.read_text()
    if _RUNS_THE_FLOW.search(source):
        return True
    imported = {module or name.strip() for module, names in _TESTS_IMPORT.findall(source)
                for name in ([""] if module else names.split(","))}
    helpers = (path.with_name(f"{name}.py") for name in imported if name)
    return any(helper != path and helper.exists() and runs_the_flow(helper) for helper in helpers)


class _SkippedModule(pytest.Module):
    def collect(self):
        pytest.skip(_megatron_training_missing(), allow_module_level=True)


def pytest_pycollect_makemodule(module_path, parent):
    if module_path.name.startswith("test_") and runs_the_flow(module_path) and _missing_training() is not None:
        return _SkippedModule.from_parent(parent, path=module_path)
    return None


_missing_training = functools.cache(_megatron_training_missing)


def pytest_collection_modifyitems(config, items):
    missing = {name: functools.cache(check) for name, check in REQUIREMENTS.items()}
    for item in items:
        if runs_the_flow(Path(item.fspath)):
            item.add_marker(pytest.mark.megatron_training)
        for name, why in missing.items():
            if item.get_closest_marker(name) is not None and why() is not None:
                item.add_marker(pytest.mark.skip(reason=why()))
    items[:] = _longest_modules_first(items)


# Each test module's measured seconds (setup, call and teardown of its tests, on the 2-core guest), written by
# `python -m pytest -n 3 --dist loadscope --record-module-seconds`: only the order below reads it, so an
# old file costs time, never a result.
MODULE_SECONDS = Path(__file__).with_name("module_seconds.json")


def _module(nodeid: str) -> str:
    return nodeid.partition("::")[0]


def _longest_modules_first(items: list) -> list:
    """The test modules longest first (``MODULE_SECONDS``; modules it lacks after them, in their order),
    each module's tests in their own order. pytest-xdist's ``--dist loadscope`` hands the modules to its
    workers in this order, so the long ones start at once instead of running alone at the end: in
    alphabetical order the README's command took 20 min 46 s."""
    seconds = json.loads(MODULE_SECONDS.read_text()) if MODULE_SECONDS.exists() else {}
    first = {}
    for index, item in enumerate(items):
        first.setdefault(_module(item.nodeid), index)
    return sorted(items, key=lambda item: (-seconds.get(_module(item.nodeid), 0.0), first[_module(item.nodeid)]))


def pytest_addoption(parser):
    parser.addoption("--record-module-seconds", action="store_true",
                     help=f"write each test module's seconds to tests/{MODULE_SECONDS.name} at the end")


class _ModuleSeconds:
    """Adds up each module's test durations as their reports arrive (from every xdist worker) and writes
    them at the end of a run that failed nothing."""

    def __init__(self):
        self.seconds = collections.Counter()

    def pytest_runtest_logreport(self, report):
        self.seconds[_module(report.nodeid)] += report.duration

    def pytest_sessionfinish(self, session, exitstatus):
        if exitstatus == 0:
            ordered = dict(sorted(((m, round(s, 1)) for m, s in self.seconds.items()), key=lambda kv: -kv[1]))
            MODULE_SECONDS.write_text(json.dumps(ordered, indent=1) + "\n")


def pytest_configure(config):
    if config.getoption("--record-module-seconds") and not hasattr(config, "workerinput"):
        config.pluginmanager.register(_ModuleSeconds(), "module-seconds")


@contextlib.contextmanager
def throwaway_package(tmp_path, monkeypatch, prefix: str, modules: dict[str, str]):
    """A fresh, uniquely named importable package under ``tmp_path`` holding ``modules`` (name -> source,
    ``{pkg}`` replaced by the package name), forgotten from sys.modules afterwards. Unique because
    wrapt's import hooks cannot be unregistered: no two tests may hook one module name."""
    name = f"{prefix}_{uuid.uuid4().hex}"
    root = tmp_path / name
    root.mkdir()
    for module, source in {"__init__": "", **modules}.items():
        (root / f"{module}.py").write_text(source.replace("{pkg}", name))
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    try:
        yield name
    finally:
        for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[module]


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
    _forget_npu_kernel_modules()
    torch_npu_double.CALLS.clear()
    yield importlib.import_module("adapter.kernels.npu_provider")
    _forget_npu_kernel_modules()


@pytest.fixture(autouse=True)
def _cuda_connections_restored():
    """megatron.training's validate_args, run in a test's own process, sets CUDA_DEVICE_MAX_CONNECTIONS=1 off CUDA
    (patches/megatron_lm.py): put back after each test, or the ranks a later test of this worker starts inherit
    it (Megatron-FSDP refuses it)."""
    before = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    yield
    if before is None:
        os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    else:
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = before


def _forget_npu_kernel_modules() -> None:
    """Drop the modules that import torch_npu (and the package's names for them: ``from adapter.kernels
    import x`` would hand back a module bound to an earlier double)."""
    import adapter.kernels

    for name in ("npu_provider", "npu_moe_permute"):
        sys.modules.pop(f"adapter.kernels.{name}", None)
        vars(adapter.kernels).pop(name, None)


@pytest.fixture(params=["torch", "cuda", "npu"])
def provider(request):
    """Each kernel provider in turn; the npu one runs against the torch_npu double."""
    from adapter import kernels

    if request.param == "npu":
        return request.getfixturevalue("npu_kernels")
    return kernels.select_provider(request.param)

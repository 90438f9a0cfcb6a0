"""The layers run one way (.importlinter, docs/ARCHITECTURE.md): ``lint-imports`` keeps every contract on
this checkout, and an arrow the wrong way, direct or through another module, breaks one."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys

import pytest

from tests.distributed import ROOT

pytestmark = pytest.mark.skipif(importlib.util.find_spec("importlinter") is None,
                                reason="import-linter is not installed (pip install -e .[test])")
LINT = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"


def _lint(cwd) -> subprocess.CompletedProcess:
    """``lint-imports`` from ``cwd`` with this interpreter (its script may not be on PATH)."""
    return subprocess.run([sys.executable, "-c", LINT, "--no-cache"], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def test_every_contract_is_kept():
    done = _lint(ROOT)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "Contracts: 2 kept, 0 broken." in done.stdout


@pytest.mark.parametrize("module, line, broken", [
    ("adapter/device.py", "import models.config", "adapter.device is not allowed to import models"),
    ("patches/rng.py", "import flow.gpt", "patches is not allowed to import flow"),
    ("models/qwen.py", "import patches.rng", "models is not allowed to import patches"),
    ("flow/gpt.py", "import scripts.pretrain_gpt", "flow is not allowed to import scripts"),
    ("models/gpt.py", "import flow.gpt", "models is not allowed to import flow"),
    ("adapter/run.py", "import flow.pretrain", "adapter.run is not allowed to import flow"),
], ids=["core->models", "patches->flow", "models->patches", "flow->scripts", "models->flow", "core->flow"])
def test_an_arrow_the_wrong_way_breaks_a_contract(tmp_path, module, line, broken):
    """On a copy of the checkout, one import added the wrong way."""
    copy = tmp_path / "checkout"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(".git", ".venv*", "__pycache__", "*.egg-info"))
    with open(copy / module, "a") as source:
        source.write(f"\n{line}  # noqa\n")
    done = _lint(copy)
    assert done.returncode == 1
    assert broken in done.stdout, done.stdout[-3000:]

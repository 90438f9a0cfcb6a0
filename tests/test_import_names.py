"""The adapter's own top-level packages, ``patches`` and ``models``, under their plain names: ``import
adapter`` imports the patch table and no model config, and a user's own ``models`` or ``patches`` first on
``sys.path`` is refused there, in one line naming both paths, instead of deep inside the flow."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from adapter import own_packages
from tests.distributed import ROOT


def _run(cwd, script: str) -> subprocess.CompletedProcess:
    """``python -c script`` from ``cwd``, the adapter importable as if installed (its checkout on
    PYTHONPATH, after the script's own directory, as site-packages would be)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ADAPTER_BACKEND": "cpu"}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_import_adapter_loads_the_patch_table_and_no_model_config(tmp_path):
    done = _run(tmp_path, """
        import sys
        import adapter
        print("patches" in sys.modules, "models" in sys.modules, "flow" in sys.modules)
    """)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["True", "False", "False"]


@pytest.mark.parametrize("clash", ["models package", "models.py file", "patches package", "imported first"])
def test_a_users_own_package_first_on_the_path_is_refused_in_one_line(tmp_path, clash):
    name = "patches" if clash.startswith("patches") else "models"
    if clash == "models.py file":
        (tmp_path / "models.py").write_text("USER = True\n")
        theirs = tmp_path / "models.py"
    else:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("USER = True\n")
        theirs = tmp_path / name / "__init__.py"
    first = f"import {name}\n" if clash == "imported first" else ""
    done = _run(tmp_path, first + "import adapter\n")
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last == (f"adapter.own_packages.PackageClashError: `import {name}` reaches {theirs}, not the "
                    f"adapter's {ROOT / name}: the adapter imports its own `{name}` package by that name. Rename "
                    f"your `{name}`, or run from a directory where it is not first on sys.path."), last


def test_without_a_clash_the_report_names_the_adapters_folders():
    assert own_packages.rows() == [{"package": "patches", "path": str(ROOT / "patches")},
                                   {"package": "models", "path": str(ROOT / "models")}]
    assert sys.modules["patches"].__file__ == str(ROOT / "patches" / "__init__.py")

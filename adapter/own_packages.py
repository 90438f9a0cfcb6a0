"""The adapter's own top-level packages, ``patches`` and ``models``: checked once, at ``import adapter``.

Both are common names in training repositories. A script run beside its project's own ``models/`` has that
directory first on ``sys.path``, and then a plain ``import models`` inside the adapter would give the
user's package: an ImportError deep inside the flow, or silently the wrong module. The adapter's code
imports its packages by their plain names (every edge visible to readers, IDEs and ``lint-imports``), so
the clash is refused here, before anything is imported, in one line naming both paths and the fix.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # where adapter/, models/ and patches/ sit
NAMES = ("patches", "models")


class PackageClashError(ImportError):
    """``patches`` or ``models`` reaches another package than the adapter's own."""


def _reaches(name: str) -> str | None:
    """The file ``import <name>`` gives (or gave): the imported module's, else what the path finders would
    find, without importing it; None when nothing (or a module without a file) answers."""
    module = sys.modules.get(name)
    if module is not None:
        return getattr(module, "__file__", None)
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    return spec.origin if spec is not None and spec.has_location else None


def _ours(name: str) -> Path:
    return ROOT / name / "__init__.py"


def check_plain_names() -> None:
    """Refuse a ``patches`` or ``models`` on ``sys.path`` (or already imported) that is not the adapter's."""
    for name in NAMES:
        reached = _reaches(name)
        if reached is None or Path(reached).resolve() != _ours(name):
            raise PackageClashError(
                f"`import {name}` reaches {reached or 'no file'}, not the adapter's {_ours(name).parent}: "
                f"the adapter imports its own `{name}` package by that name. Rename your `{name}`, or run "
                f"from a directory where it is not first on sys.path.")


def rows() -> list[dict]:
    """For the report: each package and its folder (``check_plain_names`` passed at ``import adapter``)."""
    return [{"package": name, "path": str(ROOT / name)} for name in NAMES]

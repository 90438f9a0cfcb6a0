"""The adapter's own top-level packages, ``patches`` and ``models``, whatever the user's project holds.

Both are common names in training repositories. A script run next to its project's own ``models/`` has
that directory first on ``sys.path``, so a plain ``import models`` inside the adapter would give the
user's package: an ImportError deep inside the flow, or silently the wrong module. So the adapter never
relies on the plain names. At ``import adapter`` each package is imported under its own name when that
name reaches ours (a checkout, a site-packages install); when it reaches something else (or would: the
user's package is never imported to find out), ours is loaded from its folder as ``adapter.models`` /
``adapter.patches`` and the user's keeps the plain name, untouched. Inside the packages every import of
their own modules is relative, so they work under either name; the adapter's code reaches them through
``import_own``.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent  # where adapter/, models/ and patches/ sit
NAMES = ("patches", "models")
_imported_as: dict[str, str] = {}  # our package -> the module name it was imported under


def _plain_name_reaches(name: str) -> str | None:
    """The file ``import <name>`` gives (or gave): the imported module's, else what the path finders
    would find; None for nothing, or for a module without a file."""
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


def load(name: str) -> ModuleType:
    """Our package ``name``, imported under its plain name when that reaches it, else as ``adapter.<name>``."""
    if name not in _imported_as:
        reached = _plain_name_reaches(name)
        if reached is not None and Path(reached).resolve() == _ours(name):
            _imported_as[name] = name
            return importlib.import_module(name)
        _load_privately(name, reached)
    return importlib.import_module(_imported_as[name])


def _load_privately(name: str, shadow: str | None) -> None:
    private = f"adapter.{name}"
    spec = importlib.util.spec_from_file_location(private, _ours(name), submodule_search_locations=[
        str(ROOT / name)])
    if spec is None or not _ours(name).is_file():
        raise ImportError(f"`{name}` reaches {shadow}, not the adapter's own package, and {_ours(name)} is missing: "
                          f"reinstall the adapter (pip install megatron-device-adapter)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[private] = module  # before running it: its relative imports look it up
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[private]
        raise
    setattr(sys.modules["adapter"], name, module)
    _imported_as[name] = private


def import_own(dotted: str) -> ModuleType:
    """The adapter's module ``dotted`` (``"models.provider"``), under whichever name its package got."""
    top, _, rest = dotted.partition(".")
    package = load(top)
    return importlib.import_module(f"{package.__name__}.{rest}") if rest else package


def rows() -> list[dict]:
    """For the report: each package, the name it is imported under, its folder, and what the plain
    name reaches instead when it is shadowed."""
    out = []
    for name in NAMES:
        module = load(name)
        row = {"package": name, "imported as": module.__name__, "path": str(ROOT / name)}
        if module.__name__ != name:
            row["shadowed by"] = _plain_name_reaches(name) or "a module without a file"
        out.append(row)
    return out

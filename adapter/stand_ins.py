"""Stand-ins for megatron modules that cannot even be imported without an optional dependency.

A registry patch changes an attribute of an imported module; a module that fails at its own top-level
``import triton`` never gets that far. Megatron-LM's megatron.training.initialize imports
``enable_batch_invariant_mode`` from such a module, so without triton (every CPU and NPU machine) no
megatron.training module imports at all. A stand-in is the module object the import system hands out in
its place: only while the dependency is missing, only for the megatron-core versions it was checked
against (the registry's version rule), and never for the dependency itself. Faking ``triton`` would tell
torch and every other library that probes for it that triton is there.

``install`` puts the finder first on ``sys.meta_path``; ``uninstall`` takes it out and drops the stand-in
modules already imported, so the next import gets the real module (or its ImportError) again.
``rows()`` is what ``python -m adapter`` reports about each one.
"""

from __future__ import annotations

import dataclasses
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import Callable

MARK = "__adapter_stand_in__"  # set on a stand-in module: its reason


@dataclasses.dataclass(frozen=True)
class StandIn:
    module: str  # the module stood in for
    requires: str  # the top-level module whose absence makes ``module`` unimportable
    reason: str  # one line
    versions: str  # megatron-core versions it was checked against
    fill: Callable[[types.ModuleType], None]  # gives the stand-in module its attributes
    checked: Callable[[str], bool]  # whether the installed megatron-core is in ``versions``


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self):
        self.stand_ins: dict[str, StandIn] = {}

    def find_spec(self, fullname, path=None, target=None):
        stand_in = self.stand_ins.get(fullname)
        if stand_in is None or _not_needed(stand_in):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, origin="adapter stand-in")

    def create_module(self, spec):
        return None  # the default module object

    def exec_module(self, module):
        stand_in = self.stand_ins[module.__name__]
        setattr(module, MARK, stand_in.reason)
        stand_in.fill(module)


_FINDER = _Finder()


def _not_needed(stand_in: StandIn) -> str | None:
    """Why ``stand_in`` does not stand in now, or None when it does."""
    if importlib.util.find_spec(stand_in.requires) is not None:
        return f"{stand_in.requires} is importable: the real module is imported"
    if not stand_in.checked(stand_in.versions):
        return f"checked against megatron-core {stand_in.versions} only: the real module's import fails"
    return None


def install(stand_in: StandIn) -> None:
    _FINDER.stand_ins[stand_in.module] = stand_in
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def uninstall() -> None:
    """Stand in for nothing from now on; forget the stand-in modules already imported."""
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    for name in list(_FINDER.stand_ins):
        if hasattr(sys.modules.get(name), MARK):
            del sys.modules[name]


def rows() -> list[dict]:
    """Per stand-in, for the environment report: 'applied' (imported as the stand-in), 'pending' (will
    be, on import) or 'skipped', with why."""
    result = []
    for stand_in in _FINDER.stand_ins.values():
        not_needed = _not_needed(stand_in)
        if _FINDER not in sys.meta_path:
            status, why = "skipped", "uninstalled (adapter.stand_ins.uninstall())"
        elif hasattr(sys.modules.get(stand_in.module), MARK):
            status, why = "applied", f"{stand_in.requires} is not importable"
        elif not_needed:
            status, why = "skipped", not_needed
        else:
            status, why = "pending", f"{stand_in.requires} is not importable: importing the module gives the stand-in"
        result.append({"module": stand_in.module, "requires": stand_in.requires, "reason": stand_in.reason,
                       "versions": stand_in.versions, "status": status, "why": why})
    return result

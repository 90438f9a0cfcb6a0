"""Which ``megatron.core`` a run of Megatron-LM's scripts imports: the installed megatron-core
distribution's, not a checkout's.

``megatron`` is a namespace package: a Megatron-LM checkout on PYTHONPATH comes before site-packages, so
its megatron/core would shadow the installed one. The installed distribution is the version the adapter's
patches were checked against, and the one that ships the compiled dataset helpers (helpers_cpp).
megatron.training comes from where Python finds it first: a checkout on PYTHONPATH, else, from 0.17, the
megatron-core wheel, which ships it (0.16.1's wheel does not); megatron.legacy only ever from a checkout.
Used by ``python -m adapter.run`` and by the sitecustomize hook it gives every process of a run; also
where megatron.training comes from (``megatron_training``) and the Megatron-LM checkout itself
(``megatron_lm_checkout``).
"""

from __future__ import annotations

import dataclasses
import importlib.abc
import importlib.metadata
import importlib.util
import sys
from pathlib import Path


class _InstalledMegatronCore(importlib.abc.MetaPathFinder):
    """Finds ``megatron.core`` in the installed distribution, whatever comes first on sys.path; its
    submodules follow from the package's __path__."""

    def __init__(self, directory: Path):
        self.directory = directory

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "megatron.core":
            return None
        return importlib.util.spec_from_file_location(fullname, self.directory / "__init__.py",
                                                      submodule_search_locations=[str(self.directory)])


def installed_megatron_core() -> Path | None:
    """The megatron/core directory of the installed megatron-core distribution (None: not installed, or
    installed without one, e.g. editable from a checkout)."""
    try:
        init = importlib.metadata.distribution("megatron-core").locate_file("megatron/core/__init__.py")
    except importlib.metadata.PackageNotFoundError:
        return None
    init = Path(init)
    return init.parent if init.is_file() else None


def prefer_installed_megatron_core() -> None:
    """From now on ``import megatron.core`` finds the installed distribution's, if there is one (call it
    before anything imports megatron.core). It goes after the finder that routes megatron's CUDA spellings
    (``adapter.cuda_routing``), which asks the finders behind it for the spec it routes."""
    core = installed_megatron_core()
    if core is not None and not any(isinstance(f, _InstalledMegatronCore) for f in sys.meta_path):
        routing = [i for i, f in enumerate(sys.meta_path) if getattr(f, "routes_cuda", False)]
        sys.meta_path.insert(routing[0] + 1 if routing else 0, _InstalledMegatronCore(core))


WHEEL = "the megatron-core wheel"
CHECKOUT = "a Megatron-LM checkout"


@dataclasses.dataclass(frozen=True)
class TrainingSource:
    """Where ``megatron.training`` is imported from: its directory, and whether that is the megatron-core
    wheel's (0.17+) or a Megatron-LM checkout's (the only source on 0.16)."""

    directory: Path  # .../megatron/training
    origin: str  # WHEEL or CHECKOUT

    def __str__(self):
        return f"megatron.training from {self.origin} ({self.directory})"


def megatron_training() -> TrainingSource | None:
    """Where ``megatron.training`` comes from, or None where it is not importable (0.16 without a
    checkout). It is the wheel's when it is the directory next to the installed distribution's
    megatron/core; anything else is a checkout (or a source tree installed editable)."""
    try:
        spec = importlib.util.find_spec("megatron.training")
    except ModuleNotFoundError:  # no megatron package at all
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    directory = Path(next(iter(spec.submodule_search_locations))).resolve()
    core = installed_megatron_core()
    in_wheel = core is not None and directory == (core.parent / "training").resolve()
    return TrainingSource(directory, WHEEL if in_wheel else CHECKOUT)


def megatron_lm_checkout() -> Path | None:
    """The root of the Megatron-LM checkout that provides ``megatron.training`` (where pretrain_gpt.py is),
    or None where megatron.training is not importable or is the megatron-core wheel's."""
    training = megatron_training()
    if training is None or training.origin != CHECKOUT:
        return None
    return training.directory.parent.parent

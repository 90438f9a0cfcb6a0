"""Entries of megatron's layer specs in the form of each supported megatron-core release.

0.16 writes every entry as a ``ModuleSpec(module, submodules=...)``, built by ``build_module``. Since 0.17
the MoE entries (the layer, its experts) and since 0.19 the dense MLP are builders instead,
``partial(cls, submodules=...)``, called as they are. Tests that reach into a spec read either form here.
"""

from __future__ import annotations

import functools

from packaging.version import Version

from adapter.registry import installed_megatron_core_version

# megatron-core 0.17 or later: the MoE spec entries are builders, the legacy GroupedMLP is gone, and the
# unfused permute argsorts the routing map to a given row count instead of masked_select-ing it
SINCE_0_17 = Version(installed_megatron_core_version()) >= Version("0.17")


def submodules_of(entry):
    """The ``submodules`` an entry builds its module with."""
    if isinstance(entry, functools.partial):
        return entry.keywords["submodules"]
    return entry.submodules


def module_of(entry):
    """The class (or, for a builder, the callable) an entry builds."""
    return entry.func if isinstance(entry, functools.partial) else entry.module


def build(entry, *args, **kwargs):
    """The module an entry builds from ``args`` / ``kwargs``, as megatron builds it in that release."""
    if isinstance(entry, functools.partial):
        return entry(*args, **kwargs)
    from megatron.core.transformer.spec_utils import build_module

    return build_module(entry, *args, **kwargs)

"""Imports the adapter first in every Python process that ``python -m adapter.run`` starts.

adapter.run puts this directory first on PYTHONPATH, so the interpreter imports this module at start-up,
before the process's main module. That reaches the processes adapter.run cannot: multiprocessing 'spawn'
children, such as megatron's persistent async checkpoint worker, re-import the entry script (which imports
megatron at its top) in a fresh interpreter. The adapter comes first, so that megatron.core is the
installed distribution's and the patch table is armed before anything else can import megatron; then
the sitecustomize this one shadows, if the environment has one, runs as it would have.
"""

import importlib.machinery
import importlib.util
import os
import sys

import adapter  # noqa: F401 - the backend and the patch table
from adapter.core_source import prefer_installed_megatron_core

prefer_installed_megatron_core()


def _run_shadowed() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


_run_shadowed()

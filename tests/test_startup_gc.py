"""scripts/pretrain_gpt.py keeps Python's cyclic garbage collector off through its imports and freezes what they
made before megatron.training runs (scripts/pretrain_gpt.py ``_imported``): no full collection walks the heap
while it grows, and none of the run walks the imported modules again."""

from __future__ import annotations

import pytest

from tests.distributed import run_program

PROGRAM = r"""
import gc
import json
import runpy
import sys

import wrapt

before = gc.get_stats()[2]["collections"]
seen = {}


def recorded(train, *args):  # what megatron.training would start with
    seen.update(enabled=gc.isenabled(), frozen=gc.get_freeze_count(),
                full_collections_during_imports=gc.get_stats()[2]["collections"] - before)
    print(json.dumps(seen), flush=True)
    return 0


wrapt.register_post_import_hook(lambda module: setattr(module, "run_guarded", recorded), "adapter.run")
sys.argv = ["scripts/pretrain_gpt.py"]
runpy.run_path("scripts/pretrain_gpt.py", run_name="__main__")
"""


@pytest.mark.slow
def test_the_entry_collects_nothing_during_its_imports_and_freezes_them_before_the_run():
    seen = run_program(PROGRAM)
    assert seen["enabled"] and seen["full_collections_during_imports"] == 0
    assert seen["frozen"] > 100_000  # the modules, classes and functions megatron and torch define


def test_importing_the_entry_leaves_the_collector_as_it_was():
    """Tests and tools import the script's functions (tests/elastic_rank.py): only its run as a program
    changes the collector."""
    program = ("import gc, json, adapter; frozen = gc.get_freeze_count(); import scripts.pretrain_gpt; "
               "print(json.dumps([gc.isenabled(), gc.get_freeze_count() == frozen]))")
    assert run_program(program) == [True, True]

"""One rank of ``scripts/run_megatron_tests.py``: Megatron-LM's own unit tests, unchanged, under pytest.

Run as ``python scripts/megatron_test_rank.py CHECKOUT EVENTS [pytest arguments]`` with torchrun's
environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT). In order:

1. the checkout goes first on sys.path and becomes the cwd, so ``tests.unit_tests`` is Megatron-LM's and
   megatron.training its checkout's; ``megatron.core`` is the installed distribution's
   (``adapter.core_source``), the version the adapter's patches were checked against;
2. ``import adapter``: megatron gets what every user gets, nothing more;
3. ``adapter.route_cuda("tests")`` once pytest's assertion rewriter is installed (it must come after that
   finder, or the rewritten test modules would bypass the routing): the tests' own CUDA spellings (Utils'
   ``backend='nccl'``, ``torch.cuda.set_device``, ``.cuda()``) reach this backend's device; a test file
   outside any package, which pytest imports under its own name, is routed under that name;
4. tests that need a CUDA-only library are skipped by ``skip_rules``, decided from the test's code and
   parameters alone, so every rank skips the same tests (a rank that skipped a collective would hang the
   others); failures that are only a CUDA-only library missing are reported as such skips;
5. every outcome goes, one JSON line each and flushed at once, to EVENTS, which the launcher reads to
   follow progress, find a hung test and fold the ranks together;
6. with ``MEGATRON_TESTS_MAX_GROUPS`` set, the process groups nothing holds any more are destroyed after
   each test (``DroppedGroups``), and once that many groups are still alive on some rank, the ranks stop
   cleanly and the launcher starts a fresh set for the rest: each gloo group keeps its threads, so one
   process running a whole directory would end up with thousands of threads per rank, and creating
   groups slows until it hangs.
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import os
import signal
import sys
from pathlib import Path

import pytest

if __package__:  # imported as scripts.megatron_test_rank (the harness's own tests)
    from scripts import megatron_npu_stand_in as npu_stand_in
    from scripts import megatron_skip_rules as skip_rules
else:  # run as a file: its directory is sys.path[0] until main() puts the checkout there
    import megatron_npu_stand_in as npu_stand_in
    import megatron_skip_rules as skip_rules


class RankPlugin:
    """Routes the tests' package, applies the skip rules and writes each outcome to the events file."""

    def __init__(self, events: Path, deselect: set[str], max_groups: int | None = None):
        self.events = open(events, "a", buffering=1)
        self.deselect = deselect
        self.max_groups, self.session, self.stopped = max_groups, None, False
        self.groups = DroppedGroups()

    def write(self, **event) -> None:
        self.events.write(json.dumps(event) + "\n")

    @pytest.hookimpl(tryfirst=True)
    def pytest_load_initial_conftests(self, early_config, parser, args):
        """After the assertion rewriter's finder went in, before the first conftest is imported."""
        import adapter

        adapter.route_cuda("tests")

    def pytest_collect_file(self, file_path, parent):
        """pytest imports a test file outside any package (Megatron's tests/unit_tests/distributed has no
        ``__init__.py``) as a top-level module named after the file, outside ``tests``: route that name."""
        if file_path.name.startswith("test_") and file_path.suffix == ".py" and not (
                file_path.parent / "__init__.py").exists():
            import adapter

            adapter.route_cuda(file_path.stem)

    @pytest.hookimpl(tryfirst=True)
    def pytest_fixture_setup(self, fixturedef, request):
        """Megatron's conftests ask ``is_te_min_version`` in an autouse fixture that only sets TE's
        environment; without TE that raises for every test, so there the fixture does nothing."""
        if skip_rules.asks_only_te_version(fixturedef.func):
            fixturedef.func = skip_rules.no_transformer_engine

    def pytest_collection_modifyitems(self, session, config, items):
        """Drop the tests an earlier set of ranks settled; mark those needing a CUDA-only library skipped."""
        kept = [item for item in items if item.nodeid not in self.deselect]
        if len(kept) != len(items):
            config.hook.pytest_deselected(items=[i for i in items if i.nodeid in self.deselect])
            items[:] = kept
        for item in items:
            reason = skip_rules.cuda_only_need(item)
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=f"{skip_rules.PREFIX}{reason}"))

    def pytest_collection_finish(self, session):
        """The tests this rank will run: after every plugin's deselection (``-m`` comes after this
        plugin's ``pytest_collection_modifyitems``)."""
        self.write(event="collected", nodeids=[item.nodeid for item in session.items])

    def pytest_runtest_logstart(self, nodeid, location):
        self.write(event="start", nodeid=nodeid)

    def pytest_sessionstart(self, session):
        self.session = session

    def pytest_runtest_logreport(self, report):
        self.write(event="report", nodeid=report.nodeid, when=report.when, **outcome_of(report))

    def pytest_runtest_logfinish(self, nodeid, location):
        """Groups that nothing references any more are destroyed after each test; when the groups still
        alive on some rank reach the limit, or when the ranks have created different numbers of groups,
        every rank stops after this test (ranks hold different groups: they agree, see
        ``DroppedGroups.agree``). Different numbers come from a test that stopped part way, at a
        different point on different ranks (one that needs Transformer Engine several helpers deep):
        torch names each new group by that count, so the next test's groups would pair ranks wrongly and
        its collectives hang."""
        if not (self.max_groups and torch_distributed_ready()):
            return
        self.groups.release_dropped()
        alive, created = self.groups.agree()
        if created[0] != created[1]:
            self.stopped = True
            self.session.shouldstop = (f"the ranks created {created[0]} to {created[1]} process groups; "
                                       "a fresh set goes on")
        elif alive >= self.max_groups:
            self.stopped = True
            self.session.shouldstop = f"{alive} process groups alive on a rank; a fresh set goes on"

    def pytest_collectreport(self, report):
        """A failed collection is an outcome; every collected module is progress (the launcher's timeout
        counts from the last event, and importing megatron's test modules on 8 ranks takes a while)."""
        if report.outcome != "passed":
            self.write(event="report", nodeid=report.nodeid, when="collect", **outcome_of(report))
        else:
            self.write(event="collecting", nodeid=report.nodeid)

    def pytest_sessionfinish(self, session, exitstatus):
        self.write(event="finished", status=int(exitstatus))


def torch_distributed_ready() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


class DroppedGroups:
    """Process groups megatron dropped, destroyed. ``destroy_model_parallel`` forgets its groups without
    destroying them, and each gloo group keeps three threads: a rank running a whole directory would end
    with thousands of threads, and creating groups slows until it hangs. A group that nothing but torch's
    own tables refers to can never be used again, so destroying it (which involves no other rank) changes
    no test; a group a test, a fixture or megatron still holds is left alone. A table torch adds in a later
    release, and does not appear in ``_TABLES``, makes every group look held: nothing is destroyed then."""

    _TABLES = ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config", "pg_to_tag", "pg_coalesce_state")

    def __init__(self):
        self.control, self.control_world = None, None  # the ranks' own group for agreeing on a count
        self.controls_made = 0  # alike on every rank: each makes one at the same test end

    @classmethod
    def _torch_references(cls, pg, world) -> int:
        held = sum(pg in getattr(world, table, {}) for table in cls._TABLES)
        return held + sum(other is pg for groups in world.tags_to_pg.values() for other in groups)

    def release_dropped(self) -> int:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        world, dropped = distributed_c10d._world, []
        for pg in list(world.pg_map):  # getrefcount counts the list, ``pg`` and its own argument: 3
            if pg is not world.default_pg and sys.getrefcount(pg) - 3 == self._torch_references(pg, world):
                dropped.append(pg)
        for pg in dropped:
            dist.destroy_process_group(pg)
        return len(dropped)

    def agree(self) -> tuple[int, tuple[int, int]]:
        """(the most groups alive on a rank, (the fewest, the most) groups any rank has created), agreed on
        over a gloo group of the harness's own (created at the first test end, again after a test
        re-initialised the world), never the tests' groups: a rank still inside a test's collective keeps
        the others waiting here, not paired with it."""
        import torch
        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        world = distributed_c10d._world
        if self.control is None or self.control_world is not world.default_pg:
            self.control, self.control_world = self._control_group(), world.default_pg
        counts = torch.tensor([len(world.pg_map) - 1, -world.group_count, world.group_count])
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MAX
        self.control.allreduce([counts], options).wait()
        return int(counts[0]), (-int(counts[1]), int(counts[2]))

    def _control_group(self):
        """Every rank's gloo group, met in the default group's store under a name of the harness's own, outside
        torch's tables: ``new_group`` names a group by how many groups this rank has made, which is what may
        differ here, and would then pair ranks wrongly and hang where it should find that out."""
        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        self.controls_made += 1
        store = dist.PrefixStore(f"megatron_test_rank/control{self.controls_made}",
                                 distributed_c10d._get_default_store())
        return dist.ProcessGroupGloo(store, dist.get_rank(), dist.get_world_size(), datetime.timedelta(minutes=30))


def outcome_of(report) -> dict:
    """``{"outcome", "reason"}`` of one report; a failure that is only a CUDA-only library missing, or
    one this Python cannot install, becomes a skip naming it."""
    if report.outcome == "skipped":
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        return {"outcome": "skipped", "reason": reason.removeprefix("Skipped: ")}
    if report.outcome == "passed":
        return {"outcome": "passed", "reason": ""}
    text = report.longreprtext
    need = skip_rules.missing_library(text)
    if need is not None:
        return {"outcome": "skipped", "reason": f"{skip_rules.PREFIX}{need} (raised at run time)"}
    gated = skip_rules.not_installable_library(text)
    if gated is not None:
        return {"outcome": "skipped", "reason": f"{skip_rules.NOT_INSTALLABLE}{gated} (raised at run time)"}
    return {"outcome": "failed", "reason": skip_rules.last_error_line(text), "detail": text[-4000:]}


def _put_checkout_first(checkout: Path) -> None:
    """The checkout replaces this script's directory as sys.path[0], and is the cwd (pytest's rootdir).
    The script's directory goes last instead: a process megatron spawns (dist_checkpointing's async save
    starts a ``spawn`` multiprocessing Manager) imports this script again, and with it the rules."""
    here = sys.path[0]
    sys.path[0] = str(checkout)
    sys.path.append(here)
    os.chdir(checkout)


def main(argv: list[str]) -> int:
    """pytest's exit status for this rank (the launcher reads the events, not the status, for outcomes)."""
    checkout, events, *pytest_args = argv
    checkout = Path(checkout).resolve()
    deselect_file = os.environ.get("MEGATRON_TESTS_DESELECT")
    deselect = set(Path(deselect_file).read_text().split("\n")) - {""} if deselect_file else set()
    # the launcher asks for the stack of a rank it is about to kill; into a file of its own, as pytest
    # captures the rank's stderr while a test runs
    faulthandler.register(signal.SIGUSR1, file=open(f"{events}.stack", "w"))
    _put_checkout_first(checkout)
    _adapter_first()
    max_groups = int(os.environ.get("MEGATRON_TESTS_MAX_GROUPS") or 0) or None
    plugin = RankPlugin(Path(events), deselect, max_groups)
    status = int(pytest.main(pytest_args, plugins=[plugin]))
    return 0 if plugin.stopped and status == pytest.ExitCode.INTERRUPTED else status


def _adapter_first():
    """The backend (with the npu stand-in when asked) and the patch table, before anything imports
    megatron; ``megatron.core`` then comes from the installed distribution."""
    if os.environ.get("ADAPTER_BACKEND") == "npu":
        npu_stand_in.install(int(os.environ.get("WORLD_SIZE", "1")))
    import adapter
    from adapter.core_source import prefer_installed_megatron_core

    prefer_installed_megatron_core()
    return adapter


def prepare_spawned_child() -> None:
    """A process megatron spawns (dist_checkpointing's persistent async-save worker) imports this script
    as ``__mp_main__`` before it unpickles its target: the child gets what its rank has, as a user's
    process gets ``import adapter`` from the top of their training script. Without it the worker meets the
    real ``torch.cuda`` (``set_device(rank % device_count())``), dies, and its rank waits for it forever."""
    _adapter_first().route_cuda("tests")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
elif __name__ == "__mp_main__":
    prepare_spawned_child()

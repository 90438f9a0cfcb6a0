"""scripts/run_megatron_tests.py, the harness that runs Megatron-LM's own unit tests on CPU through the
adapter, against a fake Megatron-LM checkout built here: its conftest and Utils spell CUDA as Megatron's
do (``backend='nccl'``, ``torch.cuda.set_device``, ``.cuda()``, a TE-version autouse fixture), and its
tests pass, fail, need Transformer Engine, run a 2-rank collective, fail on one rank only, or hang.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from scripts import megatron_skip_rules as rules
from scripts import run_megatron_tests as harness

ROOT = Path(__file__).resolve().parent.parent

CONFTEST = '''
import os

import pytest
import torch

from megatron.core.utils import is_te_min_version
from tests.unit_tests.test_utilities import Utils


@pytest.fixture(scope="function", autouse=True)
def set_env():
    if is_te_min_version("1.3"):
        os.environ["NVTE_FLASH_ATTN"] = "0"


@pytest.fixture(scope="session", autouse=True)
def cleanup():
    yield
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
'''

UTILITIES = '''
import os

import torch


class Utils:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("LOCAL_RANK", "0"))

    @staticmethod
    def initialize_distributed():
        if not torch.distributed.is_initialized():
            torch.cuda.set_device(Utils.rank % torch.cuda.device_count())
            torch.distributed.init_process_group(backend="nccl", world_size=Utils.world_size, rank=Utils.rank)
'''

BASIC = '''
import torch

from tests.unit_tests.test_utilities import Utils


def test_passes():
    assert torch.ones(2).cuda().sum().item() == 2


def test_fails():
    assert 1 + 1 == 3, "arithmetic"


def test_needs_te():
    import transformer_engine  # noqa: F401


def test_collective():
    Utils.initialize_distributed()
    total = torch.ones(1).cuda()
    torch.distributed.all_reduce(total)
    assert total.item() == Utils.world_size


def test_fails_on_rank_1():
    assert Utils.rank != 1, "rank 1 disagrees"


def test_tmp_path(tmp_path):
    (tmp_path / "written").write_text(str(Utils.rank))


def test_spawned_manager():  # as dist_checkpointing's async save starts one
    import multiprocessing

    queue = multiprocessing.get_context("spawn").Manager().Queue()
    queue.put(Utils.rank)
    assert queue.get() == Utils.rank
'''

# a directory without __init__.py, as Megatron's tests/unit_tests/distributed: pytest imports the file as a
# top-level module of its own name
OUTSIDE_PACKAGE = '''
import torch


def test_cuda_in_a_file_outside_the_package():
    assert [torch.nn.Linear(2, 2).cuda() for _ in range(2)][1].weight.is_cuda
'''

# each test creates one process group and holds it, and passes only as the first test its process runs
SETS = '''
import os

import torch

from tests.unit_tests.test_utilities import Utils

RAN, HELD = [], []


def _first_in_this_process():
    Utils.initialize_distributed()
    HELD.append(torch.distributed.new_group([0, 1]))
    RAN.append(os.getpid())
    assert len(RAN) == 1, f"test number {len(RAN)} in process {os.getpid()}"


def test_one():
    _first_in_this_process()


def test_two():
    _first_in_this_process()


def test_three():
    _first_in_this_process()
'''

# groups created and dropped, as megatron's destroy_model_parallel drops its own: destroyed after the test,
# they count against no limit, and the next test runs in the same process
DROPPED = '''
import os

import torch
from torch.distributed import distributed_c10d

from tests.unit_tests.test_utilities import Utils

RAN, NAMES = [], []


def test_drops_its_groups():
    Utils.initialize_distributed()
    for _ in range(5):
        group = torch.distributed.new_group([0, 1])
        torch.distributed.all_reduce(torch.ones(1), group=group)
        NAMES.append(group.group_name)
    RAN.append(os.getpid())


def test_runs_in_the_same_process_with_the_groups_destroyed():
    assert RAN == [os.getpid()]
    assert set(NAMES).isdisjoint(distributed_c10d._world.pg_names.values())
'''

# a test that makes one more process group on rank 1 than on rank 0, as a test does that stops part way at a
# different point on each rank (Transformer Engine needed several helpers deep): torch names each new group
# by the count of groups made, so the next test's group pairs rank 0's name with rank 1's other name, and hangs
DIVERGE = '''
import torch

from tests.unit_tests.test_utilities import Utils


def test_makes_one_more_group_on_rank_1():
    Utils.initialize_distributed()
    if torch.distributed.get_rank() == 1:
        torch.distributed.new_group([1])


def test_after_it():
    Utils.initialize_distributed()
    group = torch.distributed.new_group([0, 1])
    torch.distributed.all_reduce(torch.ones(1), group=group)
'''

HANG = '''
import time


def test_hangs():
    time.sleep(3600)


def test_after_the_hang():
    pass
'''

BACKEND = '''
import os

import torch

from tests.unit_tests.test_utilities import Utils


def test_routed_to_the_backend():
    Utils.initialize_distributed()
    backend = os.environ["ADAPTER_BACKEND"]
    assert torch.cuda.is_available()  # routed: the backend's device (the CPU on cpu) is there
    assert torch.distributed.get_backend() == {"cpu": "gloo", "npu": "hccl"}[backend]
'''


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """A fake Megatron-LM checkout: tests/unit_tests with Megatron's shape (a ``tests`` package, as this
    repository's own, which the ranks must not import)."""
    root = tmp_path_factory.mktemp("Megatron-LM")
    unit = root / "tests" / "unit_tests"
    unit.mkdir(parents=True)
    for path, text in {"tests/__init__.py": "", "tests/unit_tests/__init__.py": "",
                       "tests/unit_tests/conftest.py": CONFTEST, "tests/unit_tests/test_utilities.py": UTILITIES,
                       "tests/unit_tests/test_basic.py": BASIC, "tests/unit_tests/test_backend.py": BACKEND,
                       "tests/unit_tests/hang/test_hang.py": HANG, "tests/unit_tests/sets/test_sets.py": SETS,
                       "tests/unit_tests/sets/test_dropped.py": DROPPED,
                       "tests/unit_tests/sets/test_diverge.py": DIVERGE,
                       "tests/unit_tests/nopackage/test_outside.py": OUTSIDE_PACKAGE}.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(textwrap.dedent(text))
    return root


# --timeout of the runs that end in a hang (killed that long after the last event of any rank): a fresh set of
# 2 ranks on these fake tests went from its first event to its last in 3 to 12 s on 2 loaded cores (load 2.5
# to 6.6), so no gap between two events of a healthy set reaches 15 s, which still tells the hang from
# progress, at 15 s less per hang than 30 s
HANG_TIMEOUT = 15


def run_harness(checkout: Path, *args: str, timeout: float = 240) -> tuple[int, list[str], dict]:
    """The harness as a user runs it: (exit status, output lines, JSON report)."""
    report = checkout / f"report-{abs(hash(args))}.json"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "run_megatron_tests.py"), "--megatron-lm",
                           str(checkout), "--json", str(report), *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout)
    lines = done.stdout.strip().splitlines()
    assert lines, done.stderr[-3000:]
    return done.returncode, lines, json.loads(report.read_text())


@pytest.fixture(scope="module")
def basic_run(checkout):
    """The basic tests, the one outside the package and the backend's, on the cpu backend: one set of ranks."""
    return run_harness(checkout, "--nproc", "2", "--timeout", "120", "--backend", "cpu",
                       "tests/unit_tests/test_basic.py", "tests/unit_tests/nopackage",
                       "tests/unit_tests/test_backend.py")


# ---------------------------------------------------------------- the harness on the fake checkout
@pytest.mark.multiproc
@pytest.mark.slow
def test_last_line_counts_and_exit_status(basic_run):
    status, lines, report = basic_run
    assert lines[-1] == "6 passed, 2 failed, 1 skipped"
    assert status == 1
    assert report["directories"] == {"tests/unit_tests": {"passed": 5, "failed": 2, "skipped": 1},
                                     "tests/unit_tests/nopackage": {"passed": 1, "failed": 0, "skipped": 0}}


@pytest.mark.multiproc
@pytest.mark.slow
def test_routed_test_code_and_collective_pass_on_both_ranks(basic_run):
    tests = basic_run[2]["tests"]
    for name in ("test_basic.py::test_passes", "test_basic.py::test_collective", "test_basic.py::test_tmp_path",
                 "test_basic.py::test_spawned_manager",
                 "nopackage/test_outside.py::test_cuda_in_a_file_outside_the_package"):
        assert tests[f"tests/unit_tests/{name}"]["ranks"] == {"0": "passed", "1": "passed"}


@pytest.mark.multiproc
@pytest.mark.slow
def test_transformer_engine_test_is_skipped_with_the_reason(basic_run):
    _, lines, report = basic_run
    outcome = report["tests"]["tests/unit_tests/test_basic.py::test_needs_te"]
    assert outcome["outcome"] == "skipped"
    assert outcome["reason"].startswith("CUDA-only: Transformer Engine")
    assert any(line.startswith("SKIPPED tests/unit_tests/test_basic.py::test_needs_te - CUDA-only: Transformer "
                               "Engine") for line in lines)


@pytest.mark.multiproc
@pytest.mark.slow
def test_a_failure_on_one_rank_fails_the_test(basic_run):
    _, lines, report = basic_run
    outcome = report["tests"]["tests/unit_tests/test_basic.py::test_fails_on_rank_1"]
    assert outcome["outcome"] == "failed"
    assert outcome["ranks"] == {"0": "passed", "1": "failed"}
    assert "rank 1: AssertionError: rank 1 disagrees" in outcome["reason"]
    assert any(line.startswith("FAILED tests/unit_tests/test_basic.py::test_fails - rank 0: AssertionError: "
                               "arithmetic") for line in lines)


@pytest.mark.multiproc
@pytest.mark.slow
def test_a_hung_test_is_killed_counted_failed_and_the_rest_still_run(checkout):
    status, lines, report = run_harness(checkout, "--nproc", "2", "--timeout", str(HANG_TIMEOUT),
                                        "tests/unit_tests/hang/test_hang.py")
    assert lines[-1] == "1 passed, 1 failed, 0 skipped"
    assert status == 1
    hung = report["tests"]["tests/unit_tests/hang/test_hang.py::test_hangs"]
    assert hung["outcome"] == "failed" and hung["reason"].startswith("killed: no rank reported progress")
    assert "in test_hangs" in hung["reason"]  # where the rank's stack dump says it was
    assert report["tests"]["tests/unit_tests/hang/test_hang.py::test_after_the_hang"]["outcome"] == "passed"


@pytest.fixture(scope="module")
def unlimited_run(checkout):
    """--groups-per-set 0, the ranks comparing nothing after a test, over the diverging tests (the second hangs
    and is killed), then the sets' tests in the fresh set that goes on: each part as in a run of its own."""
    return run_harness(checkout, "--nproc", "2", "--timeout", str(HANG_TIMEOUT), "--groups-per-set", "0",
                       "tests/unit_tests/sets/test_diverge.py", "tests/unit_tests/sets/test_sets.py")


def _outcomes(report: dict, module: str) -> dict[str, str]:
    prefix = f"tests/unit_tests/sets/{module}::"
    return {nodeid[len(prefix):]: test["outcome"] for nodeid, test in report["tests"].items()
            if nodeid.startswith(prefix)}


@pytest.mark.multiproc
@pytest.mark.slow
def test_groups_per_set_runs_each_set_in_fresh_ranks(checkout):
    _, lines, _ = run_harness(checkout, "--nproc", "2", "--groups-per-set", "1", "tests/unit_tests/sets/test_sets.py")
    assert lines[-1] == "3 passed, 0 failed, 0 skipped", lines


@pytest.mark.multiproc
@pytest.mark.slow
def test_without_a_groups_limit_one_set_runs_every_test(unlimited_run):
    """One set ran all three sets' tests: the later two saw the first's process."""
    _, lines, report = unlimited_run
    assert lines[-1] == "2 passed, 3 failed, 0 skipped", lines  # with the diverging tests' 1 passed, 1 failed
    assert _outcomes(report, "test_sets.py") == {"test_one": "passed", "test_two": "failed", "test_three": "failed"}
    assert "test number 2" in report["tests"]["tests/unit_tests/sets/test_sets.py::test_two"]["reason"]


@pytest.mark.multiproc
@pytest.mark.slow
def test_groups_nothing_holds_are_destroyed_and_cost_no_fresh_set(checkout):
    _, lines, _ = run_harness(checkout, "--nproc", "2", "--groups-per-set", "2",
                              "tests/unit_tests/sets/test_dropped.py")
    assert lines[-1] == "2 passed, 0 failed, 0 skipped", lines


@pytest.mark.multiproc
@pytest.mark.slow
def test_ranks_that_made_different_numbers_of_groups_go_on_in_a_fresh_set(checkout):
    """The first set stops after the test that left rank 1 one group more, without a hang: with --max-attempts 1
    a set killed there (the ranks' own agreement on the counts once paired them by torch's group count, the
    very number that differs, and hung) would leave the next test failed."""
    _, lines, _ = run_harness(checkout, "--nproc", "2", "--timeout", "120", "--groups-per-set", "400",
                              "--max-attempts", "1", "tests/unit_tests/sets/test_diverge.py")
    assert lines[-1] == "2 passed, 0 failed, 0 skipped", lines


@pytest.mark.multiproc
@pytest.mark.slow
def test_without_a_groups_limit_the_test_after_diverging_ranks_hangs(unlimited_run):
    """With --groups-per-set 0 the ranks compare nothing after a test: the next test's collective hangs."""
    _, _, report = unlimited_run
    assert _outcomes(report, "test_diverge.py") == {"test_makes_one_more_group_on_rank_1": "passed",
                                                    "test_after_it": "failed"}
    after = report["tests"]["tests/unit_tests/sets/test_diverge.py::test_after_it"]
    assert after["reason"].startswith("killed: no rank reported progress"), after


@pytest.mark.multiproc
@pytest.mark.slow
def test_backend_routes_the_tests_nccl_and_torch_cuda_on_cpu(basic_run):
    """In the basic run (--backend cpu): passed on both ranks, as in a run of its own."""
    outcome = basic_run[2]["tests"]["tests/unit_tests/test_backend.py::test_routed_to_the_backend"]
    assert (outcome["outcome"], outcome["ranks"]) == ("passed", {"0": "passed", "1": "passed"}), outcome


@pytest.mark.multiproc
@pytest.mark.slow
def test_backend_routes_the_tests_nccl_and_torch_cuda_on_npu(checkout):
    status, lines, _ = run_harness(checkout, "--nproc", "2", "--backend", "npu", "tests/unit_tests/test_backend.py")
    assert (status, lines[-1]) == (0, "1 passed, 0 failed, 0 skipped"), lines


def test_not_a_checkout_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        harness.parse_args(["--megatron-lm", str(tmp_path)])


# ---------------------------------------------------------------- folding ranks, without ranks
def _events(*reports) -> list[dict]:
    out = []
    for nodeid, when, outcome in reports:
        if when == "setup":
            out.append({"event": "start", "nodeid": nodeid})
        out.append({"event": "report", "nodeid": nodeid, "when": when, "outcome": outcome,
                    "reason": "boom" if outcome == "failed" else ""})
    return out


def test_a_test_finished_only_on_some_ranks_is_not_folded_and_its_running_rank_is_known():
    whole = [("t::a", "setup", "passed"), ("t::a", "call", "passed"), ("t::a", "teardown", "passed")]
    done0, running0, _ = harness.rank_results(_events(*whole))
    done1, running1, last = harness.rank_results(_events(*whole, ("t::b", "setup", "passed")))
    assert (set(running0), running1, last) == (set(), {"t::b"}, "t::b")
    folded = harness.fold_ranks([done0, done1])
    assert set(folded) == {"t::a"} and folded["t::a"].outcome == "passed"
    hung = harness.unfinished([running0, running1], killed=True, statuses=[None, None], where=["", "f.py:3"])
    assert hung["t::b"].outcome == "failed" and hung["t::b"].reason.endswith("(hung on rank 1 at f.py:3)")


def test_fold_failed_beats_skipped_beats_passed():
    passed, skipped, failed = (harness.Outcome(o, o) for o in ("passed", "skipped", "failed"))
    folded = harness.fold_ranks([{"x": passed, "y": skipped, "z": skipped},
                                 {"x": skipped, "y": failed, "z": skipped}])
    assert {k: v.outcome for k, v in folded.items()} == {"x": "skipped", "y": "failed", "z": "skipped"}
    assert folded["y"].reason == "rank 1: failed"


def test_report_ends_with_the_count_line():
    lines = []
    out = types.SimpleNamespace(write=lambda s: lines.append(s))
    failures = harness.report({"a": harness.Outcome("passed"), "b": harness.Outcome("skipped", "why")}, out=out)
    assert failures == 0
    assert "".join(lines).splitlines()[-1] == "1 passed, 0 failed, 1 skipped"


# ---------------------------------------------------------------- the skip rules
def _item(source: str, params: dict | None = None, directory: Path | None = None):
    """A stand-in for a collected pytest item whose function has ``source`` (in a file, for inspect)."""
    namespace: dict = {}
    if directory is not None:
        path = directory / f"fake_{abs(hash(source))}.py"
        path.write_text(textwrap.dedent(source))
        exec(compile(path.read_text(), str(path), "exec"), namespace)
    else:
        exec(textwrap.dedent(source), namespace)
    fn = next(v for k, v in namespace.items() if k.startswith("test"))
    return types.SimpleNamespace(function=fn, cls=None,
                                 callspec=types.SimpleNamespace(params=params) if params else None)


@pytest.mark.parametrize("params, need", [
    ({"use_te": True}, "Transformer Engine"), ({"spec": "te"}, "Transformer Engine"),
    ({"fp8": "e4m3"}, "FP8"), ({"use_cudagraphable_rng": True}, "CUDA graphs"),
    ({"use_te": False, "fp8": None, "cuda_graph_impl": "none"}, None)])
def test_parameters_decide_a_skip(params, need, monkeypatch):
    monkeypatch.setattr(rules, "code_of_test", lambda item: "")
    reason = rules.cuda_only_need(_item("def test_x(): pass", params))
    assert (reason or "").startswith(need or "") and (reason is None) == (need is None)


@pytest.mark.parametrize("body, need", [
    ("spec = get_gpt_layer_with_transformer_engine_spec()", "Transformer Engine"),
    ("layer = TELayerNormColumnParallelLinear", "Transformer Engine"),
    ("config = dict(fp8='hybrid')", "FP8"), ("config = dict(cuda_graph_impl='local')", "CUDA graphs"),
    ("out = dsa_cudnn_kernels.run_fused_absorbed_sparse_attention(query)", "cuDNN frontend"),
    ("TEST = dict(fp8=None, cuda_graph_impl='none')", None)])
def test_source_rules_name_what_the_code_asks_for(tmp_path, body, need):
    reason = rules.cuda_only_need(_item(f"def test_x():\n    {body}\n", directory=tmp_path))
    assert (reason or "").startswith(need or "") and (reason is None) == (need is None)


def test_runtime_errors_that_only_miss_a_cuda_library_are_named(monkeypatch):
    assert rules.missing_library("ModuleNotFoundError: No module named 'transformer_engine'").startswith(
        "Transformer Engine")
    assert rules.missing_library("TypeError: '>=' not supported between instances of 'NoneType' and 'Version'")
    assert rules.missing_library("AttributeError: module 'megatron.core.fp8_utils' has no attribute "
                                 "'_fp8_inference_wrapped_modules'").startswith("Transformer Engine")
    assert rules.missing_library("AssertionError: Grouped GEMM is not available. Please run `pip install "
                                 "git+https://github.com/fanshiqing/grouped_gemm@v1.1.4`.").startswith("grouped_gemm")
    assert rules.missing_library("RuntimeError: Torch not compiled with CUDA enabled") is None
    # megatron-core 0.19 binds TESpecProvider to None without TE; a helper in another file builds a TE spec
    te_spec = ("gpt_layer_specs.py:233: in get_gpt_layer_with_transformer_engine_submodules\n"
               "    backend = TESpecProvider()\n              ^^^^^^^^^^^^^^^^\n"
               "E   TypeError: 'NoneType' object is not callable")
    assert rules.missing_library(te_spec).startswith("Transformer Engine")
    assert rules.missing_library("E   TypeError: 'NoneType' object is not callable") is None
    assert rules.missing_library("RuntimeError: cudnn fused DSA requires SM90+ (Hopper or later), got SM00."
                                 ).startswith("cuDNN frontend")
    assert rules.missing_library("AttributeError: megatron asked torch.cuda.nccl, which the adapter does not "
                                 "provide on the cpu backend.").startswith("NCCL")
    # plain PyTorch, only not installable on Python 3.11: not a CUDA-only skip, but one of its own
    assert rules.missing_library("ModuleNotFoundError: No module named 'emerging_optimizers'") is None
    muon = "AssertionError: Emerging Optimizers is not installed."
    monkeypatch.setattr(rules, "_installed", lambda module: False)  # as on Python 3.11 (the extra installs it on 3.12)
    assert rules.not_installable_library(muon, python=(3, 11)) == "emerging_optimizers needs Python >= 3.12"
    assert rules.not_installable_library(muon, python=(3, 12)) is None  # installable there: a real failure
    assert rules.not_installable_library("AssertionError: assert 1 == 2", python=(3, 11)) is None


HELPER_CLASS = '''
def _te_spec_with_groups():
    from megatron.core.extensions.transformer_engine import TENorm
    return TENorm


def _plain_helper():
    return 2


def test_module_helper():
    return _te_spec_with_groups()


def test_plain_module_helper():
    return _plain_helper()


class TestIndexer:
    def _create(self):
        from megatron.core.extensions.transformer_engine import TELinear
        return TELinear

    def _unused(self):
        return "transformer_engine"

    def test_calls_a_helper(self):
        return self._create()

    def test_plain(self):
        return 1
'''


def test_a_helper_the_test_calls_is_the_tests_code(tmp_path):
    path = tmp_path / "fake_helpers.py"
    path.write_text(HELPER_CLASS)
    module = types.ModuleType("fake_helpers")
    exec(compile(path.read_text(), str(path), "exec"), vars(module))
    cls = module.TestIndexer

    def item(name, owner=cls):
        return types.SimpleNamespace(function=vars(owner)[name], cls=owner if owner is cls else None,
                                     module=module, callspec=None)

    assert rules.cuda_only_need(item("test_calls_a_helper")).startswith("Transformer Engine (the test's code says")
    assert rules.cuda_only_need(item("test_module_helper", module)).startswith("Transformer Engine")
    assert rules.cuda_only_need(item("test_plain")) is None  # a helper it does not call is not its code
    assert rules.cuda_only_need(item("test_plain_module_helper", module)) is None

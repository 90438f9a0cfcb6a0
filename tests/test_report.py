"""``python -m adapter``: the environment report names the backend, versions, the kernel provider per op and
every registered patch with its outcome; a patch that cannot be applied is a row with its error, not a
crash."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys

import pytest

import adapter
from adapter import __main__ as cli
from adapter import kernels, report
from adapter.registry import PatchRegistry
from patches import megatron_lm
from tests.conftest import throwaway_package
from tests.distributed import ROOT

VERSION_KEYS = {"python", "torch", "torch_cuda", "torch_npu", "cann", "megatron_core", "megatron_lm", "apex",
                "transformer_engine", "flash_attn"}
INSTALLED_CORE = importlib.metadata.version("megatron-core")
# megatron-core 0.17+ wheels ship megatron/training; 0.16.1's does not (the wheel's own file list says which)
WHEEL_FILES = {f.as_posix() for f in importlib.metadata.files("megatron-core")}
WHEEL_SHIPS_TRAINING = "megatron/training/__init__.py" in WHEEL_FILES
OPS = {"rms_norm", "layer_norm", "swiglu", "rope", "rope_thd", "softmax", "cross_entropy", "core_attention",
       "norm_module", "grouped_gemm", "moe_permute", "gated_delta_rule", "causal_conv1d", "l2norm",
       "mla_attention", "mla_rope"}


def _run_cli(*args: str, backend: str = "cpu", pythonpath: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("ADAPTER_KERNELS", "ADAPTER_ALLOW_UNTESTED_MEGATRON")}
    env["ADAPTER_BACKEND"] = backend
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    return subprocess.run([sys.executable, "-m", "adapter", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


# ------------------------------------------------------------------------------------- the real adapter
def test_json_report_names_the_cpu_backend_and_every_registered_patch():
    done = _run_cli("--json")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    data = json.loads(done.stdout)
    assert (data["backend"], data["dist_backend"], data["device_count"]) == ("cpu", "gloo", 1)
    assert data["backend_why"] == "ADAPTER_BACKEND=cpu"
    assert set(data["versions"]) == VERSION_KEYS
    assert data["versions"]["megatron_core"] == INSTALLED_CORE
    assert data["kernel_provider"] == {"name": "torch", "why": "default for the cpu backend, ADAPTER_KERNELS unset"}
    assert set(data["kernels"]) == OPS
    assert [row["target"] for row in data["patches"]] == [p.target for p in adapter.registry.patches()]
    outcomes = {row["target"]: row["status"] for row in data["patches"]}
    assert outcomes["megatron.core.parallel_state:get_nccl_options"] == "skipped"  # npu only
    assert set(outcomes.values()) == {"applied", "skipped"}
    assert data["problems"] == []


def test_text_report_has_each_section_and_exits_zero():
    done = _run_cli()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "backend       cpu (ADAPTER_BACKEND=cpu); torch.distributed: gloo" in out
    for line in ("\nversions\n", f"\n  megatron_core       {INSTALLED_CORE}\n", "kernels: provider torch",
                 f"patches: {len(adapter.registry.patches())} registered", "no problems found"):
        assert line in out
    for patch in adapter.registry.patches():
        assert patch.target in out


def _release_stand_in(root, version: str) -> str:
    """A directory whose megatron-core metadata says ``version``: first on PYTHONPATH, it is the release
    importlib.metadata (and so the adapter) reads, while megatron itself still imports from site-packages."""
    info = root / f"megatron_core-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: megatron-core\nVersion: {version}\n")
    return str(root)


@pytest.mark.parametrize("refusal", ["backend", "release"])
def test_an_unusable_environment_is_one_line_and_exit_1(refusal, tmp_path):
    """The report is what a user runs to see what is wrong: an unusable ADAPTER_BACKEND or a megatron-core
    outside the supported range is the refusal's one line, not a traceback from the package's import."""
    if refusal == "backend":
        done = _run_cli(backend="tpu")
        expected = "python -m adapter: ADAPTER_BACKEND='tpu' is not a backend. Use one of cpu, cuda, npu"
    else:
        done = _run_cli(pythonpath=_release_stand_in(tmp_path, "0.20.0"))
        expected = ("python -m adapter: megatron-core 0.20.0 is installed; the adapter supports "
                    "megatron-core>=0.16.1,<=0.19.2")
    assert done.returncode == 1, done.stderr[-3000:]
    assert done.stdout == ""
    assert done.stderr.startswith(expected) and done.stderr.count("\n") == 1, done.stderr[-3000:]


def test_without_megatron_lm_its_patches_are_skipped_with_why_and_nothing_is_a_problem():
    """A pip install: megatron.legacy's patches wait for a checkout; megatron.training's too on 0.16, while
    0.17+ wheels ship megatron.training, so its patches apply, and the report says it is the wheel's."""
    done = _run_cli("--json", pythonpath=str(ROOT))  # a pip install: no Megatron-LM checkout
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads(done.stdout)
    rows = {row["target"]: row for row in data["patches"]
            if row["target"].startswith(("megatron.training.", "megatron.legacy."))}
    assert "megatron.training.arguments:validate_args" in rows and "megatron.legacy.fused_kernels:load" in rows
    legacy = {t: row for t, row in rows.items() if t.startswith("megatron.legacy.")}
    training = {t: row for t, row in rows.items() if t.startswith("megatron.training.")}
    assert {(row["status"], row["why"]) for row in legacy.values()} == {
        ("skipped", "megatron.legacy not importable (no Megatron-LM checkout on PYTHONPATH)")}
    if WHEEL_SHIPS_TRAINING:  # each patch applies, but for an optional one whose module this release lacks
        for target, row in training.items():
            module = target.partition(":")[0]
            path = module.replace(".", "/")
            if {f"{path}.py", f"{path}/__init__.py"} & WHEEL_FILES:
                assert row["status"] == "applied", row
            else:  # megatron.training.activation_logging before 0.18
                assert (row["status"], row["why"]) == ("skipped", f"{module} is not in megatron-core {INSTALLED_CORE}")
        wheel_training = importlib.metadata.distribution("megatron-core").locate_file("megatron/training")
        assert data["versions"]["megatron_lm"] == f"megatron.training from the megatron-core wheel ({wheel_training})"
    else:
        assert {(row["status"], row["why"]) for row in training.values()} == {
            ("skipped", "megatron.training not importable (no Megatron-LM checkout on PYTHONPATH)")}
        assert data["versions"]["megatron_lm"] == "megatron.training not found"
    assert data["problems"] == []
    [stand_in] = data["stand_ins"]
    assert (stand_in["module"], stand_in["requires"]) == (megatron_lm.BATCH_INVARIANT_KERNELS, "triton")
    if importlib.util.find_spec("triton") is not None:
        assert stand_in["status"] == "skipped" and stand_in["why"].startswith("triton is importable")
    elif not WHEEL_SHIPS_TRAINING:  # not imported by the report: megatron.training, which imports it, is absent
        assert (stand_in["status"], stand_in["why"]) == (
            "pending", "triton is not importable: importing the module gives the stand-in")
    else:  # the report imported the wheel's megatron.training, which imports it
        assert stand_in["status"] != "pending"


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=pytest.mark.cuda),
                                    pytest.param("npu", marks=pytest.mark.npu)])
def test_report_on_a_device_names_it_and_finds_no_problem(device):
    done = _run_cli("--json", backend=device)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads(done.stdout)
    assert (data["backend"], data["kernel_provider"]["name"]) == (device, device)
    assert data["device_count"] >= 1 and data["problems"] == []


# ------------------------------------------------------------------------------------- a broken table
@pytest.fixture
def package(tmp_path, monkeypatch):
    """A fresh package standing in for megatron, with one module ``target`` defining ``f``."""
    with throwaway_package(tmp_path, monkeypatch, "reportpkg", {"target": "def f():\n    return 'f'\n"}) as name:
        yield name


@pytest.fixture
def broken(package):
    """A registry with one good patch, two broken ones (a missing attribute, a missing module) and one for
    another backend."""
    registry = PatchRegistry(backend=lambda: "cpu", megatron_version=lambda: "0.16.1", copy_scope=(package,))
    for target, backends in ((f"{package}.target:f", ("cpu",)), (f"{package}.target:missing", ("cpu",)),
                             (f"{package}.absent:g", ("cpu",)), (f"{package}.target:f_npu", ("npu",))):
        registry.replace(target, lambda: "new", reason=f"patches {target}", versions="==0.16.1", backends=backends)
    yield registry
    registry.revert()


def test_broken_patch_targets_are_error_rows_and_the_rest_is_reported(broken, package):
    data = report.collect(broken)
    rows = {row["target"]: row for row in data["patches"]}
    assert [rows[t]["status"] for t in rows] == ["applied", "error", "error", "skipped"]
    missing = rows[f"{package}.target:missing"]
    assert missing["error"].startswith(f"patch target {package}.target:missing: missing does not exist")
    assert rows[f"{package}.absent:g"]["error"].startswith(
        f"importing {package}.absent failed: ModuleNotFoundError: No module named '{package}.absent'")
    assert rows[f"{package}.target:f_npu"]["why"] == "not for cpu"
    assert importlib.import_module(f"{package}.target").f() == "new"  # the good patch still went in
    assert len(data["problems"]) == 2
    assert data["problems"][0] == f"patch {package}.target:missing: {missing['error']}"
    assert data["backend"] == "cpu" and set(data["kernels"]) == OPS  # the other sections are all there

    text = report.render(data)
    assert f"  error    {package}.target:missing  [replace, ==0.16.1, cpu]" in text
    assert f"error: patch target {package}.target:missing: missing does not exist" in text
    assert "PROBLEMS (2):" in text


def test_cli_exits_1_with_the_full_report_when_problems_are_found(broken, monkeypatch, capsys):
    collect = report.collect
    monkeypatch.setattr(report, "collect", lambda: collect(broken))
    assert cli.main(["--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert len(data["problems"]) == 2 and len(data["patches"]) == 4


def test_an_optional_patch_whose_module_the_release_lacks_is_skipped_with_why(tmp_path, monkeypatch):
    """megatron.training.activation_logging is new in 0.18: on 0.17.1 its optional patch has nothing to patch,
    which is no problem. Simulated: optional patches on a module the package lacks, and, still errors, an
    optional patch on a module that is there but whose own import fails, and a required patch beside an
    optional one on a missing module."""
    modules = {"target": "def f():\n    return 'f'\n", "broken": "import {pkg}.nowhere\n"}
    with throwaway_package(tmp_path, monkeypatch, "reportopt", modules) as package:
        registry = PatchRegistry(backend=lambda: "cpu", megatron_version=lambda: "0.17.1", copy_scope=(package,))
        for target, optional in ((f"{package}.absent:g", True), (f"{package}.absent:h", True),
                                 (f"{package}.broken:g", True), (f"{package}.gone:g", True),
                                 (f"{package}.gone:h", False), (f"{package}.target:f", True)):
            registry.replace(target, lambda: "new", reason=f"patches {target}", versions="==0.17.1",
                             optional=optional)
        try:
            data = report.collect(registry)
        finally:
            registry.revert()
    rows = {row["target"].removeprefix(f"{package}."): row for row in data["patches"]}
    for target in ("absent:g", "absent:h"):
        assert (rows[target]["status"], rows[target]["why"], rows[target]["error"]) == (
            "skipped", f"{package}.absent is not in megatron-core 0.17.1", None)
    assert rows["broken:g"]["error"] == (f"importing {package}.broken failed: ModuleNotFoundError: "
                                         f"No module named '{package}.nowhere'")
    assert {rows[t]["status"] for t in ("gone:g", "gone:h")} == {"error"}
    assert rows["target:f"]["status"] == "applied"
    assert [p.split(":")[0] for p in data["problems"]] == [f"patch {package}.{t}" for t in ("broken", "gone", "gone")]
    assert f"why: {package}.absent is not in megatron-core 0.17.1" in report.render(data)


# ------------------------------------------------------------------------------------- kernels, versions
def test_every_op_names_its_implementation_for_each_provider(provider):
    rows = report.kernel_rows(provider)
    assert set(rows) == OPS
    for op, row in rows.items():
        assert row["provider"] == provider.NAME and row["implementation"], (op, row)
    swiglu = rows["swiglu"]["implementation"]
    assert swiglu.startswith("megatron's own") == (provider.bias_swiglu is None)
    assert rows["core_attention"]["implementation"].endswith(kernels.core_attention_module(provider).__qualname__)
    assert rows["norm_module"]["implementation"].endswith(kernels.norm_module(provider).__qualname__)
    assert rows["mla_attention"]["implementation"] == rows["core_attention"]["implementation"]


def test_the_mla_rope_row_names_what_megatrons_fused_entry_points_are_bound_to():
    from megatron.core.fusions import fused_mla_yarn_rope_apply as fused

    bound = fused.fused_apply_mla_rope_for_q
    assert report.kernel_rows(kernels.current())["mla_rope"]["implementation"].startswith(
        f"{bound.__module__}.{bound.__qualname__}")


def test_cann_version_read_from_the_toolkit_install_info(tmp_path, monkeypatch):
    info = tmp_path / "aarch64-linux" / "ascend_toolkit_install.info"
    info.parent.mkdir()
    info.write_text("package_name=Ascend-cann-toolkit\nversion=8.0.RC3\ninnerversion=V100R001C19\n")
    monkeypatch.setenv("ASCEND_TOOLKIT_HOME", str(tmp_path))
    assert report.cann_version() == f"8.0.RC3 ({info})"


def test_cann_version_read_from_version_cfg_else_not_found(tmp_path):
    cfg = tmp_path / "version.cfg"
    cfg.write_text("runtime_running_version=[7.3.0.1.231:8.0.RC2]\ntoolkit_running_version=[7.3.0.1.231:8.0.RC2]\n")
    assert report.cann_version(str(tmp_path)) == f"8.0.RC2 ({cfg})"
    assert report.cann_version(str(tmp_path / "none")) == (
        f"not found (no CANN install-info file or version.cfg under {tmp_path / 'none'})")

"""``python -m adapter.run``, the launcher for Megatron-LM's own scripts: its one-line errors, the choice of
megatron.core, and the hook that imports the adapter first in every process a run starts (spawn children
included). A stub "checkout" (megatron/training, megatron/core in a temporary folder) stands in for
Megatron-LM, so these run everywhere; tests/test_megatron_lm.py runs the real one."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys

import pytest

from adapter import run
from adapter.core_source import installed_megatron_core
from tests.distributed import ROOT

INSTALLED_CORE = importlib.metadata.version("megatron-core")
# megatron-core 0.17+ wheels ship megatron/training; 0.16.1's does not (the wheel's own file list says which)
WHEEL_SHIPS_TRAINING = "megatron/training/__init__.py" in {
    f.as_posix() for f in importlib.metadata.files("megatron-core")}

# Runs under adapter.run; a spawn child (as megatron's checkpoint workers are) reports what it started with.
PROBE = '''
import json, multiprocessing, os, sys

ADAPTER_BEFORE_MAIN = "adapter" in sys.modules  # at import: in the spawn child, before its main module ran


def child(queue):
    import adapter
    import megatron.core
    import megatron.core.tensor_parallel.random
    import megatron.training
    queue.put({"adapter_before_main": ADAPTER_BEFORE_MAIN, "core": megatron.core.__file__,
               "training": megatron.training.__file__, "pythonpath": os.environ["PYTHONPATH"],
               "patch": adapter.registry.status("megatron:*"),
               "routed": megatron.core.tensor_parallel.random.torch.cuda is adapter.device,
               "shadowed_sitecustomize_ran": os.environ.get("SHADOWED_SITECUSTOMIZE_RAN")})


if __name__ == "__main__":
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=child, args=(queue,))
    process.start()
    print("CHILD " + json.dumps(queue.get(timeout=120)))
    process.join()
    print("MAIN " + json.dumps({"argv": sys.argv, "path0": sys.path[0]}))
'''


def _checkout(tmp_path, core_version: str = INSTALLED_CORE):
    """A stub Megatron-LM checkout: megatron/training, and a megatron/core of ``core_version`` that fails
    if it is ever imported (the installed distribution's must be taken)."""
    megatron = tmp_path / "Megatron-LM" / "megatron"
    (megatron / "training").mkdir(parents=True)
    (megatron / "training" / "__init__.py").write_text("")
    (megatron / "core").mkdir()
    (megatron / "core" / "__init__.py").write_text("raise ImportError('the checkout\\'s megatron.core')\n")
    (megatron / "core" / "package_info.py").write_text(f"__version__ = '{core_version}'\n")
    return megatron.parent


def _launch(*args: str, pythonpath: list, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "ADAPTER_BACKEND": "cpu", "PYTHONPATH": os.pathsep.join(map(str, [*pythonpath, ROOT]))}
    return subprocess.run([sys.executable, "-m", "adapter.run", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_a_missing_script_is_one_line_and_exit_status_2(tmp_path):
    done = _launch("pretrain_gpt.py", "--num-layers", "2", pythonpath=[], cwd=tmp_path)
    assert (done.returncode, done.stderr) == (2, "adapter.run: error: no such script: pretrain_gpt.py\n")


@pytest.mark.skipif(WHEEL_SHIPS_TRAINING, reason="this megatron-core wheel ships megatron.training")
def test_without_megatron_training_it_says_where_to_get_it_and_exits_1(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must not run')\n")
    done = _launch(str(script), pythonpath=[], cwd=tmp_path)
    assert (done.returncode, done.stderr) == (1, f"adapter.run: error: {run.NO_MEGATRON_TRAINING}\n")
    assert "core_v0.16.1" in run.NO_MEGATRON_TRAINING and "PYTHONPATH" in run.NO_MEGATRON_TRAINING


@pytest.mark.skipif(not WHEEL_SHIPS_TRAINING, reason="this megatron-core wheel has no megatron.training")
def test_without_a_checkout_the_wheels_megatron_training_runs(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import megatron.training\nprint(megatron.training.__file__)\n")
    done = _launch(str(script), pythonpath=[], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == str(installed_megatron_core().parent / "training" / "__init__.py")


def test_a_checkout_of_another_megatron_core_is_refused_naming_both_versions(tmp_path):
    checkout = _checkout(tmp_path, core_version="0.15.0")
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must not run')\n")
    done = _launch(str(script), pythonpath=[checkout], cwd=tmp_path)
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"adapter.run: error: megatron-core {INSTALLED_CORE} is installed, but the "
                                  f"Megatron-LM checkout at {checkout} is megatron-core 0.15.0")
    assert f"check out the Megatron-LM tag core_v{INSTALLED_CORE}" in done.stderr


# A script written for CUDA whose own function moves a batch with .cuda() and whose main block calls it, as
# Megatron-LM 0.19's pretrain_gpt.py does in get_batch.
CUDA_SCRIPT = '''
import torch


def get_batch():
    batch = {"tokens": torch.ones(2)}
    return {key: value.cuda(non_blocking=True) for key, value in batch.items()}


if __name__ == "__main__":
    print(get_batch()["tokens"].device.type, torch.cuda.current_device(), __name__)
'''


@pytest.mark.skipif(not WHEEL_SHIPS_TRAINING, reason="megatron.training comes from a checkout before 0.17")
def test_the_scripts_own_cuda_spellings_are_routed_before_its_main_block_runs(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(CUDA_SCRIPT)
    done = _launch(str(script), pythonpath=[], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["cpu", "cpu", "__main__"]


def test_only_the_main_guard_is_held_back():
    import ast

    guards = [run._is_main_guard(ast.parse(text).body[0]) for text in (
        "if __name__ == '__main__':\n    pass", "if '__main__' == __name__:\n    pass",
        "if __name__ == 'x':\n    pass", "if DEBUG:\n    pass", "x = 1")]
    assert guards == [True, True, False, False, False]


@pytest.mark.slow
def test_spawned_children_import_the_adapter_first_and_the_installed_megatron_core(tmp_path):
    checkout = _checkout(tmp_path)
    shadowed = tmp_path / "site"
    shadowed.mkdir()
    (shadowed / "sitecustomize.py").write_text("import os\nos.environ['SHADOWED_SITECUSTOMIZE_RAN'] = '1'\n")
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    done = _launch(str(script), "--flag", "x", pythonpath=[checkout, shadowed], cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    reports = {line.split(" ", 1)[0]: json.loads(line.split(" ", 1)[1]) for line in done.stdout.splitlines()}
    assert reports["MAIN"] == {"argv": [str(script), "--flag", "x"], "path0": str(tmp_path)}
    child = reports["CHILD"]
    assert child["adapter_before_main"] is True
    assert child["pythonpath"].split(os.pathsep)[:3] == [str(run.HOOK_DIR), str(checkout), str(shadowed)]
    assert child["shadowed_sitecustomize_ran"] == "1"
    assert child["core"] == str(installed_megatron_core() / "__init__.py")
    assert child["training"] == str(checkout / "megatron" / "training" / "__init__.py")
    assert child["patch"] == "applied" and child["routed"] is True


def test_the_hook_goes_first_on_the_childrens_pythonpath_once(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["/megatron-lm", str(run.HOOK_DIR), "/deps"]))
    run.hook_children()
    run.hook_children()
    parts = os.environ["PYTHONPATH"].split(os.pathsep)
    assert parts[:3] == [str(run.HOOK_DIR), "/megatron-lm", "/deps"]
    assert parts.count(str(run.HOOK_DIR)) == 1 and len(parts) <= 4  # at most the adapter's root added, last

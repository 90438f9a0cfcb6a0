"""The test markers (pytest.ini, tests/conftest.py), and the tests the GPU and NPU CI jobs run on devices.

``cuda``, ``npu`` and ``megatron_lm`` skip their tests, with the reason, where the device or Megatron-LM
is missing; the marker tests run a small marked file through pytester with each requirement faked absent
or present. Every test that starts ranks through tests/distributed's launchers must be ``multiproc``, so
``-m "not multiproc"`` is a run without subprocess ranks; that is checked on the test sources.
"""

from __future__ import annotations

import ast
import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from adapter import core_source
from tests.distributed import run_ranks

pytest_plugins = ["pytester"]

TESTS = Path(__file__).resolve().parent

MARKED = '''
import pytest


@pytest.mark.cuda
def test_on_cuda():
    pass


@pytest.mark.npu
def test_on_npu():
    pass


@pytest.mark.megatron_lm
def test_with_megatron_lm():
    pass


def test_unmarked():
    pass
'''


@pytest.fixture
def run_marked(pytester):
    """Runs MARKED under this repository's conftest and pytest.ini; returns test name -> 'passed' or the
    skip reason."""
    pytester.makeconftest((TESTS / "conftest.py").read_text())
    (pytester.path / "pytest.ini").write_text((TESTS.parent / "pytest.ini").read_text())
    path = pytester.makepyfile(test_marked=MARKED)

    def run() -> dict[str, str]:
        passed, skipped, failed = pytester.inline_run(str(path), "-p", "no:cacheprovider").listoutcomes()
        assert not failed, [report.longreprtext for report in failed]
        outcomes = {report.nodeid.rpartition("::")[2]: "passed" for report in passed}
        outcomes.update({report.nodeid.rpartition("::")[2]: report.longrepr[2].removeprefix("Skipped: ")
                         for report in skipped})
        return outcomes

    return run


@pytest.fixture
def fake_torch_npu(tmp_path, monkeypatch):
    """Installs a stand-in torch_npu, seen by this process and its subprocesses (conftest asks a fresh
    interpreter whether torch_npu imports and sees an NPU), whose body the test gives."""

    def install(body: str) -> None:
        (tmp_path / "torch_npu.py").write_text(body)
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.setenv("PYTHONPATH", str(tmp_path))

    return install


def test_device_markers_skip_with_the_reason_where_the_requirement_is_missing(run_marked, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # importlib then finds no torch_npu
    monkeypatch.setitem(sys.modules, "megatron.training", None)
    assert run_marked() == {
        "test_on_cuda": "needs a CUDA device (torch.cuda.is_available() is False)",
        "test_on_npu": "needs an Ascend NPU (torch_npu is not installed)",
        "test_with_megatron_lm": "needs a Megatron-LM checkout on PYTHONPATH (its megatron.training and "
                                 "pretrain_gpt.py; the tag matching the installed megatron-core, e.g. core_v0.16.1)",
        "test_unmarked": "passed",
    }


@pytest.mark.parametrize("body, reason", [
    ("raise RuntimeError('libhccl.so: cannot open shared object file')",
     "needs an Ascend NPU (import torch_npu failed: RuntimeError: libhccl.so: cannot open shared object file)"),
    ("import types, torch\ntorch.npu = types.SimpleNamespace(is_available=lambda: False)",
     "needs an Ascend NPU (torch.npu.is_available() is False)"),
], ids=["without-cann", "without-device"])
def test_npu_marker_needs_a_torch_npu_that_imports_and_sees_a_device(run_marked, fake_torch_npu, body, reason):
    fake_torch_npu(body)
    assert run_marked()["test_on_npu"] == reason


def test_marked_tests_run_where_the_requirement_is_there(run_marked, fake_torch_npu, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    fake_torch_npu("import types, torch\ntorch.npu = types.SimpleNamespace(is_available=lambda: True)")
    monkeypatch.setattr(core_source, "megatron_lm_checkout", lambda: Path("/a/Megatron-LM"))
    assert set(run_marked().values()) == {"passed"}


def _mark_names(node: ast.AST) -> set[str]:
    """X of every ``pytest.mark.X`` under ``node``."""
    return {n.attr for n in ast.walk(node)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute) and n.value.attr == "mark"}


def _calls(node: ast.AST, name: str) -> bool:
    return any(isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", None)) == name
               for n in ast.walk(node))


LAUNCHERS = ("run_ranks", "launch_ranks", "launch_script")  # tests/distributed's


def test_every_test_that_starts_ranks_is_marked_multiproc():
    unmarked = []
    for path in sorted(TESTS.glob("test_*.py")):
        tree = ast.parse(path.read_text())
        module_marks = set().union(*(_mark_names(n) for n in tree.body if isinstance(n, ast.Assign)
                                     and any(getattr(t, "id", None) == "pytestmark" for t in n.targets)))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and any(_calls(node, launcher) for launcher in LAUNCHERS):
                marks = module_marks | set().union(*map(_mark_names, node.decorator_list))
                if "multiproc" not in marks:
                    unmarked.append(f"{path.name}::{node.name}")
    # a fixture cannot carry marks: a module whose fixture starts ranks needs pytestmark = multiproc
    assert unmarked == [], "mark these (or their module) pytest.mark.multiproc"


# ------------------------------------------------------------------- on a real device (gpu / npu jobs)
# The fusion flags whose functions the device's provider answers; without Transformer Engine megatron
# itself refuses apply_rope_fusion on CUDA, and its fused cross entropy there is megatron's own.
DEVICE_FUSIONS = {
    "cuda": dict(bias_activation_fusion=True, masked_softmax_fusion=True),
    "npu": dict(bias_activation_fusion=True, masked_softmax_fusion=True, apply_rope_fusion=True,
                cross_entropy_loss_fusion=True),
}


def _torch_provider_block(config):
    """megatron's local layer spec with the torch provider's norm and core attention: the reference."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from adapter import kernels

    reference = kernels.select_provider("torch")
    norm, core_attention = kernels.norm_module(reference), kernels.core_attention_module(reference)
    spec = get_gpt_layer_local_spec(normalization=config.normalization)
    attention = spec.submodules.self_attention
    attention = dataclasses.replace(attention, submodules=dataclasses.replace(
        attention.submodules, core_attention=core_attention))
    layer = dataclasses.replace(spec, submodules=dataclasses.replace(
        spec.submodules, input_layernorm=norm, pre_mlp_layernorm=norm, self_attention=attention))
    return TransformerBlockSubmodules(layer_specs=[layer] * config.num_layers, layer_norm=norm)


def tiny_gpt_on_the_device(fusions: dict) -> dict:
    """Rank function: the tiny GPT through this backend's kernel provider (fusion flags on) on its device,
    and the same weights through the torch provider's modules with megatron's unfused functions."""
    import adapter
    import models
    from adapter import backend, kernels
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from models.provider import transformer_config
    from tests.kernel_reference import one_rank_model_parallel

    device = adapter.device.torch_device()
    with one_rank_model_parallel():
        flavor = models.get("gpt-tiny")
        fused, plain = transformer_config(flavor, **fusions), transformer_config(flavor)

        def gpt(config, spec):
            return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=flavor.vocab_size,
                            max_sequence_length=flavor.seq_length, position_embedding_type="rope").to(device)

        torch.manual_seed(0)
        ours = gpt(fused, get_gpt_layer_local_spec(normalization=flavor.normalization))
        reference = gpt(plain, _torch_provider_block(plain))
        # Transformer Engine's modules keep an _extra_state the torch provider's have no place for
        reference.load_state_dict({k: v for k, v in ours.state_dict().items() if not k.endswith("_extra_state")})
        tokens = torch.randint(0, flavor.vocab_size, (2, flavor.seq_length),
                               generator=torch.Generator().manual_seed(1)).to(device)
        positions = torch.arange(tokens.shape[1], device=device).expand_as(tokens)
        results = []
        for model in (ours, reference):
            loss = model(tokens, positions, attention_mask=None, labels=torch.roll(tokens, -1, dims=1)).mean()
            loss.backward()
            results.append((loss.item(), {n: p.grad for n, p in model.named_parameters()}))
        (loss, grads), (reference_loss, reference_grads) = results
        layer = ours.decoder.layers[0]
        return dict(
            automatic=backend.select_backend("auto").name, backend=adapter.current_backend().name,
            dist_backend=adapter.current_backend().dist_backend, provider=kernels.current().NAME,
            device_types=sorted({p.device.type for p in ours.parameters()}), loss=loss,
            reference_loss=reference_loss, grad_names=sorted(grads) == sorted(reference_grads),
            max_grad_diff=max((grads[n] - reference_grads[n]).abs().max().item() for n in grads),
            modules=[type(layer.input_layernorm).__name__, type(layer.self_attention.core_attention).__name__])


@pytest.mark.multiproc
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=pytest.mark.cuda),
                                    pytest.param("npu", marks=pytest.mark.npu)])
def test_tiny_gpt_on_the_device_matches_the_torch_provider(device):
    result = run_ranks(1, tiny_gpt_on_the_device, DEVICE_FUSIONS[device],
                       env={"ADAPTER_BACKEND": device, "ADAPTER_KERNELS": ""})[0]
    assert result["automatic"] == device  # what ADAPTER_BACKEND unset would choose on this machine
    assert (result["backend"], result["provider"], result["device_types"]) == (device, device, [device])
    assert result["dist_backend"] == {"cuda": "nccl", "npu": "hccl"}[device]
    assert not {"TorchNorm", "TorchCoreAttention"} & set(result["modules"]), result["modules"]
    assert result["grad_names"]
    # float32 on both sides; the device's fused kernels round differently from the reference's
    assert result["loss"] == pytest.approx(result["reference_loss"], abs=1e-4)
    assert result["max_grad_diff"] < 1e-4


def test_modules_are_handed_out_longest_first_each_keeping_its_order(tmp_path, monkeypatch):
    """The order pytest-xdist's loadscope hands modules out in: tests/module_seconds.json's longest first,
    modules it does not know after them in collection order; a module's tests stay in their order."""
    import json
    from types import SimpleNamespace

    from tests import conftest

    (tmp_path / "seconds.json").write_text(json.dumps({"tests/b.py": 9.0, "tests/c.py": 3.0}))
    monkeypatch.setattr(conftest, "MODULE_SECONDS", tmp_path / "seconds.json")
    items = [SimpleNamespace(nodeid=n) for n in ("tests/a.py::x", "tests/b.py::y", "tests/c.py::z",
                                                 "tests/b.py::w", "tests/d.py::v")]
    assert [i.nodeid for i in conftest._longest_modules_first(items)] == [
        "tests/b.py::y", "tests/b.py::w", "tests/c.py::z", "tests/a.py::x", "tests/d.py::v"]

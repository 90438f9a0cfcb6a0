"""A checkpoint runs no code when it is loaded (issue 51, adapter/checkpoint_unpickling.py): a payload in each
pickled part of a checkpoint (torch DCP's ``.metadata``, a non-tensor item of a ``.distcp`` file, megatron-core's
``common.pt``, the legacy ``model_optim_rng.pt``; tests/tampered_checkpoints.py) is refused in one line naming the
file and the global it asked for, with a non-zero exit and no traceback, through each entry point that loads
checkpoints; the flag file its payload would touch shows that nothing in it ran. ``ADAPTER_TRUSTED_CHECKPOINTS``
loads such a checkpoint with full pickle. Genuine checkpoints load unchanged: every checkpoint committed in
tests/data and one of each format saved here read through the allow-list, and every resume test of the suite
reads through it."""

from __future__ import annotations

import io
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.version import Version

import adapter  # noqa: F401 - the patch table, before megatron
from adapter import checkpoint_unpickling
from adapter.checkpoint_unpickling import TRUSTED_ENV, MetadataUnpickler, UntrustedCheckpoint
from adapter.registry import installed_megatron_core_version
from tests import tampered_checkpoints, upgrade_checkpoint
from tests.distributed import ROOT, launch_script

pytestmark = pytest.mark.multiproc  # the helper _launch starts ranks (tests/test_markers.py)
DATA = ROOT / "tests" / "data"
FLOW = ["--model", "qwen2.5-tiny", "--num-layers", "2", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--seq-length", "32", "--lr", "1e-3", "--train-iters", "4", "--mock-data", "--eval-iters", "0",
        "--eval-interval", "1000", "--log-interval", "1", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256"]
PAYLOAD_GLOBALS = ("_operator.getitem", "posix.system")  # the payload's (tests/tampered_checkpoints.py)
COMMON_IN_DCP = Version(installed_megatron_core_version()) >= Version("0.19")  # before 0.19: common.pt


def _metadata_files() -> list[Path]:
    return sorted(DATA.rglob(".metadata"))


@pytest.mark.parametrize("metadata", _metadata_files(), ids=lambda path: path.parent.parent.name)
def test_the_committed_checkpoints_metadata_reads_through_the_allow_list_as_with_full_pickle(metadata):
    with open(metadata, "rb") as file:
        allowed = MetadataUnpickler(file, str(metadata)).load()
    with open(metadata, "rb") as file:
        full = pickle.load(file)  # the project's own committed data
    assert allowed == full


def test_a_global_outside_the_allow_list_is_refused_naming_the_file_without_importing_its_module(tmp_path,
                                                                                                 monkeypatch):
    (tmp_path / "imported_flag.py").write_text(f"open({str(tmp_path / 'imported')!r}, 'w').close()\nx = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    payloads = {"imported_flag.x": b"cimported_flag\nx\n.", "builtins.eval": b"cbuiltins\neval\n.",
                "torch.Size.__class__": b"\x80\x04\x8c\x05torch\x8c\x0eSize.__class__\x93."}  # protocol 4's
    for name, payload in payloads.items():
        with pytest.raises(UntrustedCheckpoint) as refused:
            MetadataUnpickler(io.BytesIO(payload), "ckpt/.metadata").load()
        assert refused.value.global_name == name and str(refused.value).startswith("ckpt/.metadata asks to unpickle")
        assert f"{TRUSTED_ENV}=ckpt" in str(refused.value)
    assert not (tmp_path / "imported").exists()


def test_a_refusal_survives_torch_dcp_sending_it_to_the_other_ranks():
    refused = UntrustedCheckpoint("ckpt/__0_0.distcp", "posix.system", item="rng_state", directory="ckpt")
    again = pickle.loads(pickle.dumps(refused))
    assert str(again) == str(refused) and "(item 'rng_state')" in str(again)


def test_a_trusted_directory_is_named_by_the_variable_and_nothing_else_is(tmp_path, monkeypatch):
    monkeypatch.setenv(TRUSTED_ENV, f"{tmp_path / 'a'}:{tmp_path / 'b'}")
    assert checkpoint_unpickling.trusted(tmp_path / "a" / "iter_0000002" / ".metadata")
    assert not checkpoint_unpickling.trusted(tmp_path / "ab" / ".metadata")
    monkeypatch.delenv(TRUSTED_ENV)
    assert not checkpoint_unpickling.trusted(tmp_path / "a" / ".metadata")


# ---------------------------------------------------------------- through the entry points

def _launch(argv: list[str], world_size: int, env: dict | None = None, script="scripts/pretrain_gpt.py"):
    return launch_script(script, argv, world_size, env={"ADAPTER_BACKEND": "cpu", **(env or {})}, timeout=600)


def _assert_refused(ranks: list[tuple[int, str]], file: Path, item: str | None = None) -> None:
    """Every rank exits 2; one line for the job names ``file`` (and ``item``) and a global; no traceback."""
    output = "".join(text for _, text in ranks)
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert [status for status, _ in ranks] == [2] * len(ranks), output[-5000:]
    assert len(errors) == 1 and "Traceback" not in output, output[-5000:]
    where = f"{file} (item {item!r})" if item else str(file)
    assert any(errors[0].startswith(f"error: {where} asks to unpickle {name}, ") for name in PAYLOAD_GLOBALS), errors[0]
    assert f"{TRUSTED_ENV}=" in errors[0]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """4 iterations on 1 rank, saved at 2 and 4, as torch_dist and as the legacy format."""
    out = {}
    for fmt in ("torch_dist", "torch"):
        out[fmt] = tmp_path_factory.mktemp(fmt)
        ranks = _launch([*FLOW, "--save", out[fmt], "--save-interval", "2", "--ckpt-format", fmt], 1)
        assert ranks[0][0] == 0, ranks[0][1][-4000:]
    return out


def _tampered(saved_dir: Path, tmp_path: Path, part: str) -> tuple[Path, Path, str | None]:
    """A copy of ``saved_dir`` with the payload in ``part`` of its iteration 2: the copy, the file and item."""
    copy, flag = tmp_path / "tampered", tmp_path / "flag"
    shutil.copytree(saved_dir, copy)
    (copy / "latest_checkpointed_iteration.txt").write_text("2")
    iteration = copy / "iter_0000002"
    if part == "metadata":
        tampered_checkpoints.in_metadata(iteration, flag)
        return copy, iteration / ".metadata", None
    if part in ("legacy", "common.pt"):
        file = iteration / ("mp_rank_00/model_optim_rng.pt" if part == "legacy" else "common.pt")
        tampered_checkpoints.in_torch_file(file, flag)
        return copy, file, None
    item = tampered_checkpoints.in_item(iteration, part, flag)
    return copy, iteration / "__0_0.distcp", item


@pytest.mark.slow
@pytest.mark.megatron_training
@pytest.mark.parametrize("part", ["metadata", "rng_state", "legacy"])
def test_the_flow_refuses_a_payload_in_one_line_and_runs_nothing(saved, tmp_path, part):
    load, file, item = _tampered(saved["torch" if part == "legacy" else "torch_dist"], tmp_path, part)
    fmt = ["--ckpt-format", "torch"] if part == "legacy" else []
    _assert_refused(_launch([*FLOW, "--load", load, *fmt], 1), file, item)
    assert not (tmp_path / "flag").exists()


@pytest.mark.slow
@pytest.mark.megatron_training
def test_a_genuine_checkpoint_reads_with_torch_dcp_tools_where_nothing_imported_megatron_core(saved, tmp_path):
    """Its items hold megatron-core's classes (the rerun state machine's, the arguments'), which megatron-core
    registers as torch safe globals when it is imported: a script of torch's DCP tools with the adapter alone
    reads them too."""
    script = ("import sys, adapter\nfrom torch.distributed.checkpoint.format_utils import dcp_to_torch_save\n"
              "assert 'megatron.core' not in sys.modules\ndcp_to_torch_save(sys.argv[1], sys.argv[2])\n")
    done = subprocess.run([sys.executable, "-c", script, str(saved["torch_dist"] / "iter_0000004"),
                           str(tmp_path / "whole.pt")], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "ADAPTER_BACKEND": "cpu", "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "whole.pt").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.megatron_training
def test_a_genuine_legacy_checkpoint_resumes_through_the_allow_list(saved, tmp_path):
    """The legacy format's files are looked at before megatron reads them (torch lists their globals); a
    genuine one holds only what torch and megatron-core allow, and resumes."""
    shutil.copytree(saved["torch"], tmp_path / "genuine")
    (tmp_path / "genuine" / "latest_checkpointed_iteration.txt").write_text("2")
    [(status, output)] = _launch([*FLOW, "--load", tmp_path / "genuine", "--ckpt-format", "torch"], 1)
    assert status == 0 and "error:" not in output, output[-4000:]
    assert " iteration        3/       4 |" in output and " iteration        4/       4 |" in output


@pytest.mark.slow
@pytest.mark.megatron_training
def test_the_flow_refuses_a_payload_in_common_pt_on_every_rank(tmp_path):
    """megatron-core 0.16.1's checkpoint (tests/upgrade_checkpoint.py) keeps its common state in common.pt."""
    copy = tmp_path / "tampered"
    shutil.copytree(upgrade_checkpoint.DATA, copy)
    common = copy / f"iter_{upgrade_checkpoint.SAVED_AT:07d}" / "common.pt"
    tampered_checkpoints.in_torch_file(common, tmp_path / "flag")
    _assert_refused(_launch(upgrade_checkpoint.argv(2, "--load", str(copy)), 2), common)
    assert not (tmp_path / "flag").exists()


@pytest.mark.slow
@pytest.mark.megatron_training
def test_a_trusted_directory_loads_with_full_pickle_and_trains_on(saved, tmp_path):
    load, _, _ = _tampered(saved["torch_dist"], tmp_path, "metadata")
    [(status, output)] = _launch([*FLOW, "--load", load], 1, env={TRUSTED_ENV: str(load)})
    assert status == 0, output[-4000:]
    assert (tmp_path / "flag").exists()  # what full pickle does: the payload ran
    assert " iteration        4/       4 |" in output


@pytest.mark.slow
@pytest.mark.megatron_training
@pytest.mark.parametrize("part", ["metadata", "common"])
def test_conversion_to_hugging_face_refuses_a_payload_in_one_line(saved, tmp_path, part):
    """The flow's checkpoint has no Hugging Face config beside it: without --model the conversion reads its
    common state first (a model config, were it the project's), with --model its ``.metadata`` first."""
    if part == "common":
        part = "common_state" if COMMON_IN_DCP else "common.pt"
    load, file, item = _tampered(saved["torch_dist"], tmp_path, part)
    model = ["--model", "qwen2.5-tiny"] if part == "metadata" else []
    done = subprocess.run([sys.executable, "scripts/convert_checkpoint.py", "mcore-to-hf", "--load-dir", str(load),
                           "--save-dir", str(tmp_path / "hf"), *model], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    _assert_refused([(done.returncode, done.stdout + done.stderr)], file, item)
    assert not (tmp_path / "flag").exists() and not (tmp_path / "hf").exists()


@pytest.mark.slow
def test_models_verify_refuses_a_payload_in_one_line(tmp_path):
    from models.conversion import hf_to_mcore
    from tests.hf_models import save_tiny

    hf_dir = save_tiny("qwen-gqa2-untied", tmp_path / "hf")
    hf_to_mcore(hf_dir, tmp_path / "mcore", progress=False)
    metadata = tmp_path / "mcore" / "release" / ".metadata"
    tampered_checkpoints.in_metadata(metadata.parent, tmp_path / "flag")
    done = subprocess.run([sys.executable, "-m", "models.verify", "--hf-dir", str(hf_dir), "--load",
                           str(tmp_path / "mcore"), "--tp", "2"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    _assert_refused([(done.returncode, done.stdout + done.stderr)], metadata)
    assert not (tmp_path / "flag").exists()


@pytest.mark.megatron_lm
@pytest.mark.slow
@pytest.mark.parametrize("part", ["metadata", "rng_state", "legacy", "common.pt"])
def test_megatron_lms_pretrain_gpt_refuses_a_payload_in_one_line(saved, tmp_path, part):
    import models
    from adapter.core_source import megatron_lm_checkout
    from models.megatron_lm_args import flags

    script = ["adapter.run", str(megatron_lm_checkout() / "pretrain_gpt.py"), *flags(models.get("qwen2.5-tiny"))]
    if part == "common.pt":  # megatron-core 0.16.1's checkpoint, 2 ranks at TP2 (tests/upgrade_checkpoint.py)
        copy = tmp_path / "tampered"
        shutil.copytree(upgrade_checkpoint.DATA, copy)
        file, item = copy / f"iter_{upgrade_checkpoint.SAVED_AT:07d}" / "common.pt", None
        tampered_checkpoints.in_torch_file(file, tmp_path / "flag")
        ranks = _launch([*script, *upgrade_checkpoint.argv(2, "--load", str(copy))[2:]], 2, script="-m")
    else:
        load, file, item = _tampered(saved["torch" if part == "legacy" else "torch_dist"], tmp_path, part)
        fmt = ["--ckpt-format", "torch"] if part == "legacy" else []
        ranks = _launch([*script, *FLOW[2:], "--load", load, *fmt], 1, script="-m")
    _assert_refused(ranks, file, item)
    assert not (tmp_path / "flag").exists()

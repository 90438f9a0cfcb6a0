"""torch FSDP2 through Megatron-LM's own pretrain_gpt.py (``--use-torch-fsdp2``) on the cpu backend and with the
npu kernel provider over tests/doubles' torch_npu: its loss curve is the DDP + distributed-optimizer curve (the
reference) at DP2 and TP2 x DP2, and its torch_dist checkpoint resumes exactly. Megatron-LM's validate_args
asks FSDP2 for untied embeddings and output weights (and no gradient-accumulation fusion, which the adapter
turns off without apex); torch_dist is its default format. The mechanism without the checkout:
tests/test_sharding.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import DOUBLES
from tests.distributed import ROOT
from tests.test_megatron_lm import TINY_QWEN, _checkpoint_at, _losses, _pretrain_gpt

pytestmark = [pytest.mark.megatron_lm, pytest.mark.multiproc, pytest.mark.slow]

COMMON = TINY_QWEN + ["--train-iters", "10", "--untie-embeddings-and-output-weights", "--mock-data",
                      "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--eval-iters", "0",
                      "--eval-interval", "20", "--attention-dropout", "0", "--hidden-dropout", "0"]
FSDP2, REFERENCE = ["--use-torch-fsdp2"], ["--use-distributed-optimizer"]
NPU_PROVIDER = {"ADAPTER_KERNELS": "npu", "PYTHONPATH": str(DOUBLES)}


def _run(workdir: Path, name: str, nproc: int, args: list[str], env: dict | None = None) -> dict[int, float]:
    """``torchrun -m adapter.run pretrain_gpt.py`` on the cpu backend in ``workdir``; its logged losses."""
    pythonpath = [p for p in ((env or {}).get("PYTHONPATH"), str(ROOT), os.environ.get("PYTHONPATH")) if p]
    full_env = {**os.environ, **(env or {}), "ADAPTER_BACKEND": "cpu", "OMP_NUM_THREADS": "1",
                "PYTHONPATH": os.pathsep.join(pythonpath)}
    log = workdir / f"{name}.log"
    with open(log, "w") as out:
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                               str(nproc), "-m", "adapter.run", str(_pretrain_gpt()), *COMMON, *args],
                              cwd=workdir, env=full_env, stdout=out, stderr=subprocess.STDOUT, timeout=600)
    text = log.read_text()
    assert done.returncode == 0, f"{name} failed (exit status {done.returncode}):\n{text[-6000:]}"
    return {i: float(loss) for i, loss in _losses(text).items()}


def _within(curve: dict, reference: dict, tolerance: float = 1e-5) -> bool:
    return sorted(curve) == sorted(reference) == list(range(1, 11)) and \
        max(abs(curve[i] - reference[i]) for i in curve) <= tolerance


@pytest.fixture(scope="module")
def dp2(tmp_path_factory):
    """(FSDP2 saving at 5, reference, FSDP2 resumed from 5, FSDP2 with the npu provider) at DP2."""
    workdir = tmp_path_factory.mktemp("fsdp2-dp2")
    full = _run(workdir, "fsdp2", 2, FSDP2 + ["--save", "saved", "--save-interval", "5"])
    resumed = _run(workdir, "resumed", 2, FSDP2 + ["--load", str(_checkpoint_at(workdir / "saved", 5,
                                                                                   workdir / "at5"))])
    return full, _run(workdir, "reference", 2, REFERENCE), resumed, _run(workdir, "npu", 2, FSDP2, NPU_PROVIDER)


def test_fsdp2_trains_the_distributed_optimizer_curve_at_dp2(dp2):
    full, reference, _, _ = dp2
    assert _within(full, reference)


def test_fsdp2_trains_the_same_curve_with_the_npu_provider(dp2):
    full, _, _, npu = dp2
    assert _within(npu, full)


def test_fsdp2_resumes_exactly_from_its_torch_dist_checkpoint(dp2):
    full, _, resumed, _ = dp2
    compared = (6, 8, 9, 10)  # 7 logs the mean of 6 and 7 after a restart (tests/test_megatron_lm.py)
    assert {i: resumed[i] for i in compared} == {i: full[i] for i in compared}


def test_fsdp2_trains_the_distributed_optimizer_curve_at_tp2_dp2(tmp_path):
    tp2 = ["--tensor-model-parallel-size", "2"]
    assert _within(_run(tmp_path, "fsdp2", 4, FSDP2 + tp2), _run(tmp_path, "reference", 4, REFERENCE + tp2))


def test_fsdp2_in_bf16_resumes_exactly_from_its_torch_dist_checkpoint(tmp_path):
    """bf16: megatron's mixed-precision optimizer, whose fp32 main parameters and step are saved as well."""
    bf16 = FSDP2 + ["--bf16"]
    full = _run(tmp_path, "fsdp2", 2, bf16 + ["--save", "saved", "--save-interval", "5"])
    resumed = _run(tmp_path, "resumed", 2, bf16 + ["--load", str(_checkpoint_at(tmp_path / "saved", 5,
                                                                                 tmp_path / "at5"))])
    assert {i: resumed[i] for i in (6, 8, 9, 10)} == {i: full[i] for i in (6, 8, 9, 10)}

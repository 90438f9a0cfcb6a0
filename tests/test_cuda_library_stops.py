"""What needs a CUDA library stops a Megatron-LM run in one line per job (issue 43, point 7): the flag, the
library, what to use instead, before any model is built, exit status 2 on every rank and no traceback.

The mechanism is tested without a Megatron-LM checkout (megatron-core's wheel ships megatron.training and its
``validate_args``); ``megatron_lm``-marked tests run Megatron-LM's pretrain_gpt.py itself."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

from adapter import backend, cuda_only_features
from adapter.core_source import megatron_lm_checkout
from adapter.cuda_only_features import FEATURES, CudaOnlyFeatureError
from patches.cuda_only_features import refuse_arguments
from tests.distributed import ROOT, _base_env, free_port

# (Megatron-LM's flags, the arguments they set, the library the line names, what it says to use instead)
STOPS = [
    (["--fp8-format", "hybrid"], {"fp8": "hybrid"}, "Transformer Engine", "--bf16"),
    (["--tp-comm-overlap"], {"tp_comm_overlap": True}, "Transformer Engine", "drop --tp-comm-overlap"),
    (["--moe-token-dispatcher-type", "flex"], {"moe_token_dispatcher_type": "flex"}, "DeepEP or HybridEP",
     "--moe-token-dispatcher-type alltoall"),
    (["--cuda-graph-impl", "local"], {"cuda_graph_impl": "local"}, "CUDA driver", "--cuda-graph-impl at none"),
    (["--use-nccl-ub"], {"nccl_ub": True}, "NCCL", "drop --use-nccl-ub"),
    (["--symmetric-ar-type", "two_shot"], {"symmetric_ar_type": "two_shot"}, "symmetric memory",
     "drop --symmetric-ar-type"),
]


@pytest.mark.parametrize("flags, args, library, instead", STOPS)
def test_megatron_lms_arguments_are_refused_naming_the_flag_the_library_and_what_instead(flags, args, library,
                                                                                         instead):
    ran = []
    validate = refuse_arguments(ran.append)
    with pytest.raises(CudaOnlyFeatureError) as refused:
        validate(types.SimpleNamespace(**args))
    line = str(refused.value)
    assert line.startswith(" ".join(flags) + ": ") and "\n" not in line, line
    assert library in line and instead in line and "cpu backend" in line, line
    assert ran == []  # before megatron's own checks


def test_the_ways_that_run_here_pass():
    validate = refuse_arguments(lambda args: "validated")
    for dispatcher in ("alltoall", "allgather"):
        assert validate(types.SimpleNamespace(moe_token_dispatcher_type=dispatcher, cuda_graph_impl="none",
                                              tp_comm_overlap=False, fp8=None, nccl_ub=False)) == "validated"


@pytest.mark.parametrize("flags, args, library, instead", STOPS)
def test_on_cuda_they_are_megatrons_own(monkeypatch, flags, args, library, instead):
    """On CUDA the arguments reach megatron's validate_args unrefused: megatron (and the library) decide."""
    monkeypatch.setattr(cuda_only_features.backend, "current", lambda: backend.Backend("cuda"))
    validate = refuse_arguments(lambda args: "megatron's own")
    assert validate(types.SimpleNamespace(**args)) == "megatron's own"


def test_every_feature_with_a_library_says_what_to_use_instead():
    for feature in FEATURES:
        if feature.library:
            assert feature.instead != "turn it off to run here", feature.name


# Megatron-LM's argument parsing and validate_args (the wheel's megatron.training), as pretrain_gpt.py's
# initialize_megatron starts: what the refusal ends in is adapter.run's line, not the exception.
_SCRIPT = """
from megatron.training.arguments import parse_args, validate_args
validate_args(parse_args())
print("validated")
"""


def _adapter_run(tmp_path, rank: int, flags: list[str]) -> subprocess.CompletedProcess:
    script = tmp_path / "start.py"
    script.write_text(_SCRIPT)
    env = _base_env({"ADAPTER_BACKEND": "cpu", "RANK": str(rank), "WORLD_SIZE": "2"})
    return subprocess.run([sys.executable, "-m", "adapter.run", str(script), *flags], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)


def test_under_adapter_run_the_refusal_is_rank_0s_one_line_and_status_2_on_every_rank(tmp_path):
    first, other = (_adapter_run(tmp_path, rank, ["--fp8-format", "hybrid"]) for rank in (0, 1))
    assert first.returncode == other.returncode == 2, first.stderr[-3000:] + other.stderr[-3000:]
    assert first.stderr.strip().splitlines()[-1].startswith("error: --fp8-format hybrid: fp8 / fp4 training")
    assert "Traceback" not in first.stderr + other.stderr and "error:" not in other.stderr
    assert first.stderr.count("error:") == 1 and "validated" not in first.stdout + other.stdout


TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3",
        "--train-iters", "2", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256",
        "--transformer-impl", "local", "--eval-iters", "0", "--eval-interval", "1000"]
EXTRA = {"--tp-comm-overlap": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
         "--moe-token-dispatcher-type": ["--num-experts", "4", "--moe-router-topk", "2",
                                         "--expert-model-parallel-size", "2"]}


@pytest.mark.megatron_lm
@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("flags, args, library, instead", STOPS)
def test_megatron_lms_pretrain_gpt_stops_in_one_line_through_the_launcher(tmp_path, flags, args, library,
                                                                          instead):
    """2 ranks of pretrain_gpt.py through scripts/launch.py: the refusal line, the launcher's line, status 2."""
    checkout = megatron_lm_checkout()  # the marker's: the checkout on PYTHONPATH, which the ranks inherit
    pretrain_gpt = str(checkout / "pretrain_gpt.py")
    env = _base_env({"ADAPTER_BACKEND": "cpu"})
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "launch.py"), "--nproc-per-node", "2",
                           "--master-port", str(free_port()), "-m", "adapter.run", pretrain_gpt, *TINY,
                           *EXTRA.get(flags[0], []), *flags], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 2, output[-4000:]
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: {' '.join(flags)}: "), output[-4000:]
    assert "Traceback" not in output and "building GPT model" not in output, output[-4000:]
    assert output.strip().splitlines()[-1].startswith("[launch] ") and "status 2" in output.splitlines()[-1]

"""DeepSeek-V3's features through Megatron-LM's own pretrain_gpt.py (``torchrun -m adapter.run``) on the CPU:
multi-latent attention, and the recipe's flag set (examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh) tiny,
minus what other parts of the project own (Megatron-FSDP, grouped GEMM, selective recompute, TE, the flex
dispatcher): MLA with YaRN (scaling factor 40, mscale 1), MTP, the sigmoid router with expert bias and
group-limited top-k, seq_aux_loss, shared experts, fp32 router, a dense-first --moe-layer-freq, at
PP2 x EP2 x TP2 with sequence parallelism on 8 ranks. Needs the Megatron-LM checkout (skipped otherwise)."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from adapter.core_source import megatron_lm_checkout
from tests.distributed import ROOT, free_port

pytestmark = [pytest.mark.megatron_lm, pytest.mark.multiproc, pytest.mark.slow]

TINY = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3",
        "--log-interval", "1", "--seed", "1234", "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "256", "--transformer-impl", "local", "--normalization", "RMSNorm", "--swiglu",
        "--position-embedding-type", "rope", "--disable-bias-linear", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--eval-iters", "0", "--eval-interval", "1000"]
MLA = ["--multi-latent-attention", "--q-lora-rank", "32", "--kv-lora-rank", "16", "--qk-head-dim", "16",
       "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16", "--rotary-scaling-factor", "40", "--mscale", "1.0",
       "--mscale-all-dim", "1.0", "--qk-layernorm"]
DEEPSEEK_V3_MOE = [
    "--untie-embeddings-and-output-weights", "--num-experts", "8", "--moe-layer-freq", "([0]*1+[1]*3)",
    "--moe-ffn-hidden-size", "32", "--moe-shared-expert-intermediate-size", "32",
    "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-router-topk", "2", "--moe-router-pre-softmax",
    "--moe-aux-loss-coeff", "1e-4", "--moe-router-group-topk", "2", "--moe-router-num-groups", "4",
    "--moe-router-topk-scaling-factor", "2.5", "--moe-router-score-function", "sigmoid",
    "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "1e-3", "--moe-router-dtype", "fp32",
    "--moe-permute-fusion", "--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.1", "--clip-grad", "1.0"]
TRAIN_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: (\S+) \|")


def _run(workdir: Path, nproc: int, args: list[str], **env) -> str:
    """Megatron-LM's pretrain_gpt.py through the launcher on the cpu backend; its log, or a failure with the tail."""
    env = {**os.environ, "ADAPTER_BACKEND": "cpu", "OMP_NUM_THREADS": "1", **env,
           "PYTHONPATH": os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(ROOT), os.environ.get("PYTHONPATH"))
                                         if p)}
    workdir.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(nproc), "-m", "adapter.run", str(megatron_lm_checkout() / "pretrain_gpt.py"), *args],
                          cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=900)
    assert done.returncode == 0, f"exit status {done.returncode}:\n{done.stdout[-6000:]}"
    return done.stdout


def _losses(log: str) -> dict[int, float]:
    return {int(i): float(loss) for i, loss in TRAIN_LINE.findall(log)}


def _falls(losses: dict[int, float], iterations: int) -> None:
    assert sorted(losses) == list(range(1, iterations + 1)), losses
    assert all(math.isfinite(v) for v in losses.values()), losses
    assert losses[iterations] < losses[1] - 0.1, losses


@pytest.mark.parametrize("kernels", ["torch", "npu"])
def test_multi_latent_attention_trains_at_tp2(tmp_path, kernels):
    """MLA alone at TP2 (2 query heads per rank over 24-wide query/key and 16-wide value heads), on the torch
    provider and on the npu provider's npu_fusion_attention against the torch_npu double."""
    env = {"ADAPTER_KERNELS": kernels}
    if kernels == "npu":
        env["PYTHONPATH"] = str(ROOT / "tests" / "doubles")
    log = _run(tmp_path, 2, TINY + MLA + ["--train-iters", "6", "--tensor-model-parallel-size", "2"], **env)
    _falls(_losses(log), 6)


def test_mla_without_a_query_lora_trains_at_tp2_without_a_query_norm(tmp_path):
    """--multi-latent-attention --qk-layernorm without --q-lora-rank (DeepSeek-V2-Lite's one query projection):
    megatron-core 0.19's local spec refuses it by itself (a ValueError from its QK-norm resolver); here each TP
    rank holds DeepSeek's layers and trains. Per rank, by hand: embedding 128 x 64 (tied); each of 4 layers two
    norms of 64, q_proj 48 x 64, kv_down 12 x 64, the latent's norm 16, kv_up 64 x 16, out 64 x 32, SwiGLU fc1
    128 x 64 and fc2 64 x 64; the final norm 64: 85632, with no norm of 64 before q_proj."""
    at = MLA.index("--q-lora-rank")
    log = _run(tmp_path, 2, TINY + MLA[:at] + MLA[at + 2:] + ["--train-iters", "4",
                                                              "--tensor-model-parallel-size", "2"])
    _falls(_losses(log), 4)
    counts = re.findall(r"number of parameters on \(tensor, .*?\) model parallel rank \((\d), .*?\): (\d+)", log)
    assert sorted(counts) == [("0", "85632"), ("1", "85632")], log[-3000:]


@pytest.fixture(scope="module")
def mla_curves(tmp_path_factory):
    """MLA on one rank, 4 iterations: as Megatron-LM's defaults run it (--apply-rope-fusion), with
    --no-rope-fusion, and with --recompute-modules mla_up_proj."""
    workdir = tmp_path_factory.mktemp("mla")
    runs = {"fused": [], "unfused": ["--no-rope-fusion"],
            "mla_up_proj": ["--recompute-granularity", "selective", "--recompute-modules", "mla_up_proj"]}
    return {name: _losses(_run(workdir / name, 1, TINY + MLA + ["--train-iters", "4"] + extra))
            for name, extra in runs.items()}


def test_mla_rope_fusion_trains_the_curve_of_megatrons_unfused_rope(mla_curves):
    """Megatron-LM's default --apply-rope-fusion with MLA's YaRN RoPE runs megatron's fused entry points (off
    CUDA the adapter's torch version of its Triton kernels); --no-rope-fusion, megatron's unfused RoPE: the
    same loss curve."""
    _falls(mla_curves["fused"], 4)
    assert mla_curves["fused"] == pytest.approx(mla_curves["unfused"], rel=1e-5), mla_curves


def test_recomputing_mla_up_proj_trains_the_curve_of_no_recompute(mla_curves):
    assert mla_curves["mla_up_proj"] == mla_curves["fused"]  # as logged; bit for bit in test_selective_recompute.py


def test_mla_over_ulysses_context_parallelism_trains_the_curve_without(tmp_path):
    """MLA at CP2 with --cp-comm-type a2a (24-wide query/key, 16-wide value heads through the all-to-all)
    against the same run on one rank without context parallelism."""
    args = TINY + MLA + ["--train-iters", "4"]
    cp2 = _losses(_run(tmp_path / "cp2", 2, args + ["--context-parallel-size", "2", "--cp-comm-type", "a2a"]))
    _falls(cp2, 4)
    assert cp2 == pytest.approx(_losses(_run(tmp_path / "cp1", 1, args)), rel=1e-4)


def test_mla_over_ring_context_parallelism_is_refused_in_one_line_before_the_model(tmp_path):
    """Through scripts/launch.py (torchrun itself prints a traceback of its own for a failed rank)."""
    env = {**os.environ, "ADAPTER_BACKEND": "cpu", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "launch.py"), "--nproc-per-node", "2",
                           "--master-port", str(free_port()), "-m", "adapter.run",
                           str(megatron_lm_checkout() / "pretrain_gpt.py"), *TINY, *MLA, "--train-iters", "4",
                           "--context-parallel-size", "2"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    log = done.stdout + done.stderr
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and len(errors) == 1, log[-4000:]
    assert "--cp-comm-type p2p: the adapter's ring attention" in errors[0], errors
    assert errors[0].endswith("use --cp-comm-type a2a") and "Traceback" not in log, log[-4000:]
    assert "building GPT model" not in log, log[-4000:]


def test_deepseek_v3_flag_set_trains_at_pp2_ep2_tp2(tmp_path):
    args = TINY + MLA + DEEPSEEK_V3_MOE + ["--train-iters", "4", "--pipeline-model-parallel-size", "2",
                                          "--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
                                          "--sequence-parallel"]
    log = _run(tmp_path, 8, args)
    _falls(_losses(log), 4)
    assert re.search(r"mtp_1 loss: \S+", log) and re.search(r"seq_load_balancing_loss: \S+", log), log[-3000:]

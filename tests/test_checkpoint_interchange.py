"""A training checkpoint moves between the two flows: one written by Megatron-LM's pretrain_gpt.py (through
``adapter.run``) resumes in the project's flow and one written by the flow resumes in Megatron-LM's, with the
same model flags, as Megatron-LM's own resume does (model, optimizer, LR schedule, RNG states, iteration,
consumed samples; ``adapter/training/checkpoint_common.py``).

Without the checkout: Megatron-LM's own ``load_checkpoint`` (megatron.training, in megatron-core's wheel from
0.17) reads the flow's torch_dist and fsdp_dtensor checkpoints into a scrambled model, optimizer and scheduler,
and gives back the state the flow saved. With the checkout (``megatron_lm``): both flows train 8 iterations
saving at 4, and each resumes from the other's checkpoint on the curve of the run that saved it.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from adapter.training import checkpoint_common
from adapter.training.arguments import ArgumentError
from adapter.training.checkpointing import _require_reshardable
from tests.checkpoint_interchange_ranks import megatron_lm_loads_the_flow_checkpoint
from tests.distributed import ROOT, run_ranks

# a tiny GPT whose flags both flows take (Megatron-LM's pretrain_gpt.py, and the flow's)
TINY = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
        "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size",
        "8", "--lr", "1e-3", "--log-interval", "1", "--seed", "1234", "--mock-data", "--tokenizer-type",
        "NullTokenizer", "--vocab-size", "256", "--transformer-impl", "local", "--normalization", "RMSNorm",
        "--swiglu", "--position-embedding-type", "rope", "--disable-bias-linear", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--eval-iters", "0", "--eval-interval", "1000",
        "--use-distributed-optimizer", "--ckpt-format", "torch_dist"]


# experts over 2 ranks: Megatron-LM keeps one RNG state per (PP, TP) rank, the flow one per data-parallel rank too
MOE_EP2 = ["--num-experts", "4", "--expert-model-parallel-size", "2", "--moe-router-topk", "2",
           "--moe-ffn-hidden-size", "64"]


def _same(first: list, second: list) -> bool:
    return len(first) == len(second) and all(
        torch.equal(a, b) if torch.is_tensor(a) else a == b for a, b in zip(first, second))


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("sharding", [[], ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor"]],
                         ids=["torch_dist", "fsdp_dtensor"])
def test_megatron_lm_s_own_loader_reads_the_flow_s_checkpoint(sharding, tmp_path):
    pytest.importorskip("megatron.training.checkpointing", reason="megatron-core's wheel ships megatron.training "
                                                                  "from 0.17")
    argv = TINY + ["--train-iters", "2"] + sharding
    results = run_ranks(2, megatron_lm_loads_the_flow_checkpoint, argv, str(tmp_path / "saved"))
    for result in results:
        live, by_flow, by_megatron_lm = result["live"], result["flow"], result["megatron_lm"]
        assert result["iterations"] == (2, 2) and result["consumed"] == (16, 16)
        assert by_megatron_lm["steps"] == by_flow["steps"] == live["steps"] == 16
        assert live["moments"] and all("exp_avg_sq" in moments for moments in live["moments"])
        assert _same(by_megatron_lm["params"], live["params"]) and _same(by_flow["params"], live["params"])
        for reader in (by_flow, by_megatron_lm):
            assert [sorted(m) for m in reader["moments"]] == [sorted(m) for m in live["moments"]]
            assert all(_same([m[k] for k in sorted(m)], [n[k] for k in sorted(n)])
                       for m, n in zip(reader["moments"], live["moments"]))
        assert _same(by_megatron_lm["random"], by_flow["random"])



def _flow_and_megatron_lm_flags(vocab_size: int) -> list[str]:
    """TINY with the NullTokenizer's --vocab-size of one flow: Megatron-LM 0.19's NullTokenizer holds
    --vocab-size entries, the flow's one more (the end-of-document id after them), so the flow's 255 is
    Megatron-LM's 256: the same vocabulary, end-of-document id and mock data."""
    flags = list(TINY)
    flags[flags.index("--vocab-size") + 1] = str(vocab_size)
    return flags + ["--train-iters", "8"]


@pytest.mark.megatron_lm
@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("sharding", [[], ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor"], MOE_EP2],
                         ids=["torch_dist", "fsdp_dtensor", "moe-ep2"])
def test_a_checkpoint_of_either_flow_resumes_in_the_other_on_the_curve_of_the_run_that_saved_it(sharding, tmp_path,
                                                                                                 monkeypatch):
    """Both flows train 8 iterations saving at 4, with the distributed optimizer (torch_dist; a MoE model at EP2
    too) or Megatron-FSDP (fsdp_dtensor); their curves differ from the start: they initialize the weights
    differently. Each resumes from the other's checkpoint of iteration 4 and continues the curve of the run that
    saved it bit for bit, the flow restoring Megatron-LM's RNG states (Megatron-LM's log prints the mean of
    iterations 5 and 6 at 6 after a restart, so 6 is left out where it resumes). Without dropout: from the same
    state the two flows' dropout masks differ (hidden or attention dropout 0.1: the resumed curve 1e-3 to 2e-3
    off at iteration 5, where each flow resumes its own checkpoint bit for bit); that Megatron-LM restores the
    flow's RNG states is the test above."""
    from tests.test_megatron_lm import _checkpoint_at, _losses, _run

    def flow(workdir, name: str, flags: list[str]) -> str:
        """The flow's run, on the installed megatron-core as users run it (the checkout on PYTHONPATH would
        shadow it, and its source tree lacks the compiled dataset helpers)."""
        with monkeypatch.context() as env:
            env.delenv("PYTHONPATH", raising=False)
            return _run(workdir, name, 2, flags, launch=(), script=ROOT / "scripts" / "pretrain_gpt.py")

    mlm_flags, flow_flags = _flow_and_megatron_lm_flags(256) + sharding, _flow_and_megatron_lm_flags(255) + sharding
    save = ["--save", "saved", "--save-interval", "4"]
    (tmp_path / "mlm").mkdir(), (tmp_path / "flow").mkdir()
    mlm_full = _losses(_run(tmp_path / "mlm", "full", 2, mlm_flags + save))
    flow_full = _losses(flow(tmp_path / "flow", "full", flow_flags + save))
    from_mlm = _checkpoint_at(tmp_path / "mlm" / "saved", 4, tmp_path / "from-mlm")
    from_flow = _checkpoint_at(tmp_path / "flow" / "saved", 4, tmp_path / "from-flow")
    flow_log = flow(tmp_path, "flow-from-mlm", flow_flags + ["--load", str(from_mlm)])
    flow_resumed = _losses(flow_log)
    mlm_resumed = _losses(_run(tmp_path, "mlm-from-flow", 2, mlm_flags + ["--load", str(from_flow)]))
    assert mlm_full[1] != flow_full[1]
    assert f"loaded {from_mlm / 'iter_0000004'} (iteration 4)" in flow_log  # not "RNG states not restored"
    assert flow_resumed == {i: mlm_full[i] for i in range(5, 9)}
    assert {i: mlm_resumed[i] for i in (5, 7, 8)} == {i: flow_full[i] for i in (5, 7, 8)}


SIZES = {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 4}


def test_a_checkpoint_of_another_vocabulary_is_refused_in_one_line_naming_the_null_tokenizer_s_count():
    """Megatron-LM's --vocab-size 256 with the NullTokenizer is 256 embedding rows, the flow's 257 padded to 384;
    megatron would read the 256 saved rows into 384 without a word (and Megatron-LM 384 into 256)."""
    saved = {"args": argparse.Namespace(**SIZES, padded_vocab_size=256)}
    run = argparse.Namespace(model_config=SimpleNamespace(**SIZES, vocab_size=384), tokenizer_type="NullTokenizer")
    with pytest.raises(ArgumentError) as refused:
        checkpoint_common.refuse_another_model(saved, run, Path("ckpt/iter_0000004"))
    assert str(refused.value) == (
        "--load ckpt/iter_0000004: it holds a model of padded_vocab_size 256, this run builds 384 (Megatron-LM "
        "0.19's NullTokenizer holds --vocab-size entries, the flow's one more, the end-of-document id after them, "
        "as Megatron-LM's before 0.19: give the flow Megatron-LM's --vocab-size less one): load it with the model "
        "flags that saved it")
    checkpoint_common.refuse_another_model({"args": argparse.Namespace(**SIZES, padded_vocab_size=384)}, run, "c")
    checkpoint_common.refuse_another_model({}, run, "c")  # the flow's before they held their arguments


def _layout(tp: int, dp: int) -> argparse.Namespace:
    return argparse.Namespace(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1, data_parallel_size=dp,
                              virtual_pipeline_model_parallel_size=None, expert_model_parallel_size=1,
                              expert_tensor_parallel_size=None)


def test_megatron_lm_s_dp_reshardable_optimizer_state_is_refused_at_another_model_parallel_layout():
    """Megatron-LM's default sharding of the distributed optimizer's state follows its buffers: another DP
    reads it, another TP does not (megatron raises deep in its load); fully reshardable state reads anywhere."""
    saved = checkpoint_common.layout(_layout(tp=1, dp=2))
    dp_reshardable = {"distrib_optim_sharding_type": "dp_reshardable"}
    _require_reshardable(Path("c"), dp_reshardable, saved, _layout(tp=1, dp=1))
    _require_reshardable(Path("c"), {"distrib_optim_sharding_type": "fully_reshardable"}, saved, _layout(2, 1))
    with pytest.raises(ArgumentError) as refused:
        _require_reshardable(Path("c"), dp_reshardable, saved, _layout(tp=2, dp=1))
    assert str(refused.value) == (
        "--load c: its distributed optimizer state is dp_reshardable, which reads only at the layout that saved it "
        "(tp 1 (now 2), etp 1 (now 2)): resume at that layout, load the weights alone with --no-load-optim, or "
        "save it with --dist-ckpt-optim-fully-reshardable (Megatron-LM)")


def test_a_torch_checkpoint_without_megatron_s_metadata_json_is_a_complete_fsdp_dtensor_one_to_both_flows(tmp_path):
    """The flow's fsdp_dtensor save, as Megatron-LM's, writes torch's files alone; Megatron-LM tells the format
    by megatron's metadata.json (torch_dist where it is there, fsdp_dtensor under Megatron-FSDP where not)."""
    import torch.distributed.checkpoint as dcp

    from adapter.training import fsdp_checkpoint
    from adapter import checkpoint_dir

    megatron_lm = pytest.importorskip("megatron.training.checkpointing",
                                      reason="megatron-core's wheel ships megatron.training from 0.17")
    dcp.save({"iteration": 4, "model": {"weight": torch.zeros(2)}}, checkpoint_id=str(tmp_path))
    assert checkpoint_dir.is_complete(tmp_path) and fsdp_checkpoint.format_of(tmp_path) == "fsdp_dtensor"
    assert megatron_lm._get_checkpoint_format(str(tmp_path), argparse.Namespace(use_megatron_fsdp=True)) == \
        "fsdp_dtensor"

"""bench/feature_matrix.py: how a cell's log is read (trains / refused / fails), and CI's fast subset of the
matrix: the flow's cells on the cpu backend and with the npu provider against the double."""

from __future__ import annotations

import pytest

from bench import feature_matrix

TRAINED = """\
 [2026-11-28 22:08:10] iteration        3/       4 | consumed samples: 24 | lm loss: 5.401E+00 | loss scale: 1.0 |
 [2026-11-28 22:08:10] iteration        4/       4 | consumed samples: 32 | lm loss: 5.339520E+00 | loss scale: 1.0 |
"""
TORCHRUN_REPORT = """\
Traceback (most recent call last):
  File ".../torch/distributed/run.py", line 936, in main
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
"""
WORKER_TRACEBACK = """\
[rank0]: Traceback (most recent call last):
[rank0]:   File "/m/megatron/core/transformer/spec_utils.py", line 99, in build_module
[rank0]: TypeError: CoreAttention.__init__() got an unexpected keyword argument 'k_channels'
"""


def test_a_finite_last_loss_with_exit_zero_trains():
    outcome = feature_matrix.classify(0, TRAINED)
    assert (outcome.verdict, outcome.detail) == ("trains", "loss 5.339520E+00 at iteration 4")


@pytest.mark.parametrize("log", ["", TRAINED.replace("5.339520E+00", "nan")])
def test_exit_zero_without_a_finite_last_loss_fails(log):
    assert feature_matrix.classify(0, log).verdict == "fails"


def test_one_refusal_line_and_torchrun_own_report_is_refused_with_that_line():
    line = "pretrain_gpt.py: error: --fp8-format hybrid: FP8 needs Transformer Engine (CUDA); use --bf16"
    outcome = feature_matrix.classify(1, f"usage: pretrain_gpt.py [-h]\n  [--error-injection-rate R]\n{line}\n"
                                         + TORCHRUN_REPORT)
    assert (outcome.verdict, outcome.detail) == ("refused", line)


def test_a_refusal_printed_by_every_rank_is_counted():
    line = "error: --use-torch-fsdp2 is not in this flow: run it with python -m adapter.run"
    outcome = feature_matrix.classify(2, f"[rank0]: {line}\n[rank1]: {line}\n")
    assert (outcome.verdict, outcome.detail) == ("refused", f"{line} (printed 2 times)")


def test_a_worker_traceback_fails_with_its_error_and_a_time_out_fails():
    outcome = feature_matrix.classify(1, WORKER_TRACEBACK + TORCHRUN_REPORT)
    assert outcome.verdict == "fails" and outcome.detail.startswith("TypeError: CoreAttention.__init__()")
    assert (feature_matrix.classify(None, "").verdict, feature_matrix.classify(None, "").detail) == ("fails",
                                                                                                    "timed out")


def test_the_markdown_has_a_column_per_backend_and_the_totals():
    results = {("TP2", "cpu"): feature_matrix.Outcome("trains", "loss 5.3 at iteration 4"),
               ("TP2", "npu"): feature_matrix.Outcome("refused", "a | b")}
    text = feature_matrix.markdown(results, ["cpu", "npu"], "note")
    assert "| feature | flags | ranks | cpu | npu provider (double) |" in text
    assert "| TP2 | `--tensor-model-parallel-size 2` | 2 | **trains**: loss 5.3 at iteration 4 | " \
           "**refused**: a \\| b |" in text
    assert "Totals: 1 trains, 1 refused, 0 fails." in text and "FP8" not in text


def test_with_a_checkout_a_cell_says_whether_megatron_lm_s_script_ends_the_same(tmp_path, monkeypatch):
    """The flow's outcome is the cell's verdict; Megatron-LM's pretrain_gpt.py's is compared with it."""
    theirs = {"TP2": feature_matrix.Outcome("trains", "loss 5.3 at iteration 4", 2.0),
              "SGD": feature_matrix.Outcome("fails", "TypeError: x", 2.0)}
    ran = []

    def run(feature, backend, checkout, timeout):
        ran.append(checkout)
        return (theirs[feature.name] if checkout else feature_matrix.Outcome("trains", "loss 5.3 at iteration 4", 1.0))

    monkeypatch.setattr(feature_matrix, "_run", run)
    tp2, sgd = (next(f for f in feature_matrix.FEATURES if f.name == name) for name in ("TP2", "SGD"))
    same = feature_matrix.run_cell(tp2, "cpu", tmp_path, 10)
    assert (same.verdict, same.detail, same.seconds) == (
        "trains", "loss 5.3 at iteration 4; Megatron-LM's pretrain_gpt.py: the same", 3.0)
    other = feature_matrix.run_cell(sgd, "cpu", tmp_path, 10)
    assert other.detail == "loss 5.3 at iteration 4; Megatron-LM's pretrain_gpt.py: fails, TypeError: x"
    assert feature_matrix.run_cell(sgd, "cpu", None, 10).detail == "loss 5.3 at iteration 4"
    assert ran == [None, tmp_path, None, tmp_path, None]


def test_an_update_keeps_the_recorded_cells_it_does_not_rerun(tmp_path, monkeypatch):
    """--update reruns the cells asked for; the others come back from the JSON with their columns."""
    recorded = {("TP2", "npu"): feature_matrix.Outcome("trains", "loss 5.3 at iteration 4", 12.0),
                ("SGD", "cpu"): feature_matrix.Outcome("refused", "no", 3.0)}
    feature_matrix.save_results(tmp_path / "FEATURES.json", recorded, "note")
    rerun = feature_matrix.Outcome("trains", "loss 5.1 at iteration 4", 9.0)
    monkeypatch.setattr(feature_matrix, "run_cell", lambda feature, backend, checkout, timeout: rerun)
    status = feature_matrix.main(["--update", "--only", "SGD", "--backends", "cpu",
                                  "--megatron-lm", str(tmp_path), "--out", str(tmp_path / "FEATURES.md")])
    assert status == 0
    assert feature_matrix.load_results(tmp_path / "FEATURES.json") == {**recorded, ("SGD", "cpu"): rerun}
    table = (tmp_path / "FEATURES.md").read_text()
    assert "| feature | flags | ranks | cpu | npu provider (double) |" in table
    assert "| SGD | `--optimizer sgd` | 2 | **trains**: loss 5.1 at iteration 4 | not run |" in table


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["cpu", "npu"])
def test_ci_subset_the_flow_trains_tp2_on_each_backend(backend):
    tp2 = next(f for f in feature_matrix.FEATURES if f.name == "TP2")
    outcome = feature_matrix.run_cell(tp2, backend, None, timeout=300)
    assert outcome.verdict == "trains", outcome.log[-3000:]
    assert f"kernels from the {'npu' if backend == 'npu' else 'torch'} provider" in outcome.log, outcome.log[-3000:]

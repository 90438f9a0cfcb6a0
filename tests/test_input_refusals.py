"""Bad input to megatron.training ends in one line for the job and exit status 2 on every rank (issue 50):
megatron's own failed checks in ``validate_args``, a missing --eval-interval, a megatron tokenizer without its
vocabulary files, a --data-path corpus that is
missing or holds an id outside the vocabulary (adapter/input_refusals.py, patches/input_refusals.py).

CI has no Megatron-LM checkout: these go through the wheel's megatron.training (parse_args, validate_args,
build_train_valid_test_data_iterators). The ``megatron_lm``-marked ones run Megatron-LM's pretrain_gpt.py on
2 ranks through ``adapter.run`` and scripts/launch.py (torchrun itself prints a traceback of its own for a
failed worker; the launcher says it in one line)."""

from __future__ import annotations

import re
import subprocess
import sys
import types

import numpy as np
import pytest
import torch
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

import adapter
from adapter.input_refusals import InputRefused
from tests.distributed import ROOT, _base_env, free_port

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3",
        "--train-iters", "6", "--eval-interval", "3", "--eval-iters", "1", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "256", "--transformer-impl", "local"]


@pytest.fixture(autouse=True)
def _connections_restored(monkeypatch):
    """megatron.training's validate_args, run here in the test's own process, sets CUDA_DEVICE_MAX_CONNECTIONS=1
    off CUDA (patches/megatron_lm.py): restored after each test, or later tests in this process and the ranks
    they start inherit it (Megatron-FSDP refuses it; megatron's sequence-parallel hint then goes unsaid)."""
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")


def _without(flag: str) -> list[str]:
    at = TINY.index(flag)
    return TINY[:at] + TINY[at + 2:]


# (argv, the line): megatron's condition where its assert says nothing, its message where it says one,
# the arguments its check reads with their values, and the check it lacks
REFUSED = [
    ([*TINY, "--num-attention-heads", "5"],
     "--hidden-size 64, --num-attention-heads 5: Megatron-LM's validate_args requires hidden_size % "
     "num_attention_heads == 0 when kv_channels is None"),
    ([*TINY, "--train-samples", "100"], "--train-iters 6, --train-samples 100: expected iteration-based training"),
    ([*TINY, "--fp16", "--bf16"], "--fp16, --bf16: Megatron-LM's validate_args requires not bf16 when fp16"),
    ([*TINY, "--no-position-embedding"], "--no-position-embedding, --position-embedding-type learned_absolute: "
                                         "--no-position-embedding is deprecated, use --position-embedding-type"),
    (_without("--eval-interval"), "--eval-interval is not set: Megatron-LM's training needs it to size and "
                                  "schedule validation (pass --eval-interval N; with --eval-iters 0 nothing is "
                                  "evaluated)"),
]


@pytest.mark.parametrize("argv, line", REFUSED, ids=[line[:30] for _, line in REFUSED])
def test_validate_args_refuses_in_one_line_naming_the_arguments(monkeypatch, argv, line):
    from megatron.training.arguments import parse_args, validate_args

    assert adapter.registry.status("megatron.training.arguments:validate_args") == "applied"
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *argv])
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(InputRefused) as refused:
        validate_args(parse_args())
    assert str(refused.value) == line


@pytest.mark.parametrize("tokenizer, needed", [
    ([], "--vocab-file and --merge-file"),  # Megatron-LM's pretrain_gpt.py's default, GPT2BPETokenizer
    (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "vocab.json"], "--merge-file"),
    (["--tokenizer-type", "BertWordPieceCase"], "--vocab-file"),
])
def test_a_megatron_tokenizer_without_its_files_is_one_line_not_a_download(monkeypatch, tokenizer, needed):
    """megatron-core's GPT-2 and BERT tokenizers fetch missing vocabulary files with wget on rank 0 (without it,
    a ModuleNotFoundError; offline, a hang): refused in validate_args naming the flags."""
    from megatron.training.arguments import parse_args, validate_args

    from flow.releases import ARGS_DEFAULTS

    untokenized = [word for word in TINY if word not in ("--tokenizer-type", "NullTokenizer", "--vocab-size", "256")]
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *untokenized, *tokenizer])
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(InputRefused) as refused:
        validate_args(parse_args(), ARGS_DEFAULTS)
    kind = tokenizer[1] if tokenizer else "GPT2BPETokenizer"
    assert str(refused.value).startswith(f"--tokenizer-type {kind} needs {needed} (megatron would download them)")
    assert "\n" not in str(refused.value)


def test_a_tokenizer_larger_than_the_embedding_is_one_line(monkeypatch):
    """--model NAME fixes the embedding's rows (--padded-vocab-size): a tokenizer of more entries is refused
    where megatron.training builds it, naming both sizes."""
    from megatron.training import global_vars
    from megatron.training.arguments import parse_args, validate_args

    assert adapter.registry.status("megatron.training.global_vars:build_tokenizer") == "applied"
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *TINY, "--padded-vocab-size", "128"])
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(InputRefused) as refused:
        global_vars.build_tokenizer(validate_args(parse_args()))
    assert str(refused.value).startswith("--padded-vocab-size 128: the tokenizer (NullTokenizer) has 256 entries, "
                                         "more than the embedding's 128 rows")


def test_arguments_megatron_takes_pass(monkeypatch):
    from megatron.training.arguments import parse_args, validate_args

    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *TINY, "--mock-data"])
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert validate_args(parse_args()).num_attention_heads == 4


def test_a_learning_rate_schedule_megatron_core_refuses_is_one_line_naming_the_arguments(monkeypatch):
    """megatron.training builds the scheduler after the model, outside validate_args; megatron-core's
    ``OptimizerParamScheduler`` asserts the warm-up ends before the decay without a message."""
    from megatron.training import global_vars, training
    from megatron.training.arguments import parse_args, validate_args

    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *TINY, "--lr-warmup-iters", "6"])
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", validate_args(parse_args()))
    with pytest.raises(InputRefused) as refused:
        training.get_optimizer_param_scheduler(types.SimpleNamespace(param_groups=[]))
    assert str(refused.value) == ("--lr-warmup-iters 6, --train-iters 6: the learning-rate schedule megatron builds "
                                  "from them needs lr_warmup_steps < lr_decay_steps (megatron-core's "
                                  "OptimizerParamScheduler)")


_SCRIPT = """
from megatron.training.arguments import parse_args, validate_args
validate_args(parse_args())
print("validated")
"""


@pytest.mark.multiproc
@pytest.mark.slow
def test_under_adapter_run_it_is_rank_0s_one_line_and_status_2_on_every_rank(tmp_path):
    """As pretrain_gpt.py's initialize_megatron starts, through adapter.run: the refusal ends in its line."""
    script = tmp_path / "start.py"
    script.write_text(_SCRIPT)
    ranks = [subprocess.Popen([sys.executable, "-m", "adapter.run", str(script), *TINY, "--num-attention-heads",
                               "5"], cwd=tmp_path, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=_base_env({"ADAPTER_BACKEND": "cpu", "RANK": str(rank), "WORLD_SIZE": "2"}))
             for rank in (0, 1)]
    (out0, err0), (out1, err1) = (rank.communicate(timeout=300) for rank in ranks)
    assert [rank.returncode for rank in ranks] == [2, 2], err0[-3000:] + err1[-3000:]
    assert err0.strip().splitlines()[-1] == f"error: {REFUSED[0][1]}", err0[-3000:]
    assert "Traceback" not in err0 + err1 and "error:" not in err1 and err0.count("error:") == 1
    assert "validated" not in out0 + out1


_SLOW_RANK_0 = """
import os, time
from adapter.input_refusals import InputRefused
if os.environ["RANK"] == "0":
    time.sleep(8)  # as a loaded machine can hold rank 0 back
raise InputRefused("the job's line")
"""


@pytest.mark.multiproc
@pytest.mark.slow
def test_under_torchrun_a_rank_refused_before_rank_0_leaves_rank_0_the_line(tmp_path):
    """torchrun SIGTERMs the other workers as soon as one exits non-zero: rank 1, refused first, waits for
    that, so rank 0 still says the job's line (once), and torchrun names rank 0's exit status 2."""
    script = tmp_path / "refused.py"
    script.write_text(_SLOW_RANK_0)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "adapter.run", str(script)], cwd=tmp_path, text=True, capture_output=True,
                          env=_base_env({"ADAPTER_BACKEND": "cpu"}), timeout=300)
    output = done.stdout + done.stderr
    assert output.count("error: the job's line") == 1, output[-3000:]
    assert re.search(r"rank\s*:\s*0 \(local_rank: 0\)\s+exitcode\s*:\s*2", output), output[-3000:]


# ---------------------------------------------------------------- the corpora, before megatron builds datasets
def _corpus(prefix: str, documents: list[list[int]]) -> str:
    """A corpus written by megatron-core's own IndexedDatasetBuilder, the format's reference."""
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for document in documents:
        builder.add_document(torch.tensor(document), [len(document)])
    builder.finalize(prefix + ".idx")
    return prefix


def _data_args(**given) -> types.SimpleNamespace:
    """The arguments megatron.training's data path reads (parse_args' defaults), with ``given``."""
    defaults = dict(mock_data=False, data_path=None, data_args_path=None, train_data_path=None,
                    valid_data_path=None, test_data_path=None, per_split_data_args_path=None, padded_vocab_size=256)
    return types.SimpleNamespace(**{**defaults, **given})


def _build_iterators(monkeypatch, args) -> None:
    """The wrapped megatron.training target with ``args`` as megatron's global arguments. The refusal comes
    before megatron's own code, which is never reached here (no process group, no provider)."""
    from megatron.training import global_vars, training

    assert adapter.registry.status("megatron.training.training:build_train_valid_test_data_iterators") == "applied"
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", args)
    training.build_train_valid_test_data_iterators(None)


def test_a_missing_prefix_is_refused_naming_the_files_and_what_writes_them(monkeypatch, tmp_path):
    good = _corpus(str(tmp_path / "good"), [[1, 2, 3]])
    missing = str(tmp_path / "nosuch")
    with pytest.raises(InputRefused) as refused:
        _build_iterators(monkeypatch, _data_args(valid_data_path=[good], train_data_path=[missing]))
    assert str(refused.value) == (f"--train-data-path {missing}: {missing}.bin and {missing}.idx not found; pass "
                                  "the prefix scripts/preprocess_data.py wrote (without .bin/.idx)")


def test_a_token_outside_the_padded_vocabulary_is_refused(monkeypatch, tmp_path):
    prefix = _corpus(str(tmp_path / "oov"), [[1, 2, 3], [4, 256, 5]])
    with pytest.raises(InputRefused) as refused:
        _build_iterators(monkeypatch, _data_args(data_path=["0.5", prefix, "0.5", prefix]))
    assert str(refused.value).startswith(f"{prefix}.bin holds token id 256, outside the model's vocabulary of 256")


def test_corpora_megatron_can_read_pass_and_mock_data_is_not_checked(tmp_path):
    from adapter.input_refusals import check_data

    check_data(_data_args(data_path=[_corpus(str(tmp_path / "good"), [[1, 2, 3], [4, 255, 5]])]))
    check_data(_data_args(mock_data=True, data_path=[str(tmp_path / "nosuch")]))


# ---------------------------------------------------------------- Megatron-LM's pretrain_gpt.py, 2 ranks
E2E = [(["--num-attention-heads", "5", "--mock-data"], "error: --hidden-size 64, --num-attention-heads 5: "),
       (["--mock-data"], "error: --eval-interval is not set"),
       (["--data-path", "{missing}"], "error: --data-path {missing}: {missing}.bin and {missing}.idx not found"),
       (["--data-path", "{oov}"], "error: {oov}.bin holds token id 300, outside the model's vocabulary of 256")]


@pytest.mark.megatron_lm
@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("flags, line", E2E, ids=["heads", "eval-interval", "missing-data", "oov-data"])
def test_megatron_lms_pretrain_gpt_stops_in_one_line_with_status_2(tmp_path, flags, line):
    from adapter.core_source import megatron_lm_checkout

    rng = np.random.default_rng(0)
    paths = {"missing": str(tmp_path / "nosuch"), "oov": _corpus(
        str(tmp_path / "oov"), [list(rng.integers(1, 255, 200)) for _ in range(20)] + [[1, 300, 2]])}
    base = _without("--eval-interval") if "--eval-interval" in line else TINY
    argv = [*base, "--tensor-model-parallel-size", "2", "--split", "80,10,10",
            *(flag.format(**paths) for flag in flags)]
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "launch.py"), "--nproc-per-node", "2",
                           "--master-port", str(free_port()), "-m", "adapter.run",
                           str(megatron_lm_checkout() / "pretrain_gpt.py"), *argv], cwd=tmp_path,
                          env=_base_env({"ADAPTER_BACKEND": "cpu"}), capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    errors = [text for text in output.splitlines() if text.startswith("error:")]
    assert done.returncode == 2 and len(errors) == 1, output[-4000:]
    assert errors[0].startswith(line.format(**paths)) and "Traceback" not in output, output[-4000:]
    assert " iteration " not in output, output[-4000:]


# megatron-core 0.19.2's errors when an optimizer state of one split (a ChainedOptimizer's chained_0/1 at expert
# parallel size > 1) meets a run of the other, in the forms seen 2026-12-06 in each direction and format
_DP_BUCKET = "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.float32, torch.float32).bucket_idx_0.param"
CHAINED_STATES = {
    "ep2 into ep1, dp_reshardable": KeyError(f"{_DP_BUCKET} from model not in state dict: ['chained_0.{_DP_BUCKET}', "
                                             "'decoder.final_layernorm.weight']"),
    "ep1 into ep2, dp_reshardable": KeyError(f"chained_0.{_DP_BUCKET} from model not in state dict: "
                                             f"['{_DP_BUCKET}', 'decoder.final_layernorm.weight']"),
    "ep1 into ep2, fully reshardable": RuntimeError("Expected 2 entries in state dict, but got 3."),
}


@pytest.mark.parametrize("error", CHAINED_STATES.values(), ids=CHAINED_STATES)
def test_an_optimizer_state_of_another_expert_split_is_one_line_with_the_ways_out(error):
    from adapter.input_refusals import checkpoint_refusal

    refused = checkpoint_refusal(error, types.SimpleNamespace(load="ckpt"))
    assert str(refused).startswith("--load ckpt: the checkpoint's optimizer state is split into another number of "
                                   "optimizers than this run's") and "--no-load-optim" in str(refused)


def test_a_single_optimizer_handed_a_chained_state_is_that_refusal_and_other_key_errors_are_not():
    """EP2's fully reshardable state into EP1: its tensors load unprefixed, then megatron-core's distributed
    optimizer finds no 'optimizer' entry (the chained state holds one per optimizer). Raised elsewhere, or
    for another key, a KeyError is a fault of code and keeps its traceback."""
    from adapter.input_refusals import checkpoint_refusal

    def raised_in(module: str, key: str) -> KeyError:
        try:
            exec("state = {}\nstate[key]", {"__name__": module, "key": key})
        except KeyError as exc:
            return exc

    args = types.SimpleNamespace(load="ckpt")
    assert "--no-load-optim" in str(checkpoint_refusal(raised_in("megatron.core.optimizer.distrib_optimizer",
                                                                 "optimizer"), args))
    assert checkpoint_refusal(raised_in("megatron.core.optimizer.distrib_optimizer", "param_groups"), args) is None
    assert checkpoint_refusal(raised_in("some.user.module", "optimizer"), args) is None


@pytest.mark.parametrize("files, run_format, refused", [
    (["metadata.json", "__0_0.distcp", ".metadata"], "fsdp_dtensor", "a torch_dist checkpoint"),
    (["__0_0.distcp", ".metadata"], "torch_dist", "an fsdp_dtensor or torch_dcp checkpoint"),
    (["metadata.json", ".metadata"], "torch_dist", None),
    (["__0_0.distcp", ".metadata"], "fsdp_dtensor", None),
    (["__0_0.distcp", ".metadata"], "torch_dcp", None),
    (["mp_rank_00"], "torch_dist", None),  # a legacy checkpoint: megatron reads it in a run of any format
])
def test_a_failed_load_of_a_checkpoint_of_another_format_says_so(tmp_path, files, run_format, refused):
    """Where a load fails, the iteration directory the tracker names is told by its files (as megatron.training
    tells it) and compared with the run's --ckpt-format; a failure of any kind (here an AttributeError, as torch's
    reader raises for Megatron-FSDP's checkpoint in a torch_dist run) becomes that line."""
    from adapter.input_refusals import checkpoint_refusal

    (tmp_path / "latest_checkpointed_iteration.txt").write_text("7")
    for name in files:
        (tmp_path / "iter_0000007" / name).parent.mkdir(exist_ok=True)
        (tmp_path / "iter_0000007" / name).touch()
    args = types.SimpleNamespace(load=str(tmp_path), ckpt_format=run_format, ckpt_step=None)
    said = checkpoint_refusal(AttributeError("'NoneType' object has no attribute 'items'"), args)
    if refused is None:
        assert said is None
    else:
        assert str(said).startswith(f"--load {tmp_path}: iter_0000007 holds ") and refused in str(said)
        assert f"this run reads --ckpt-format {run_format}: load it with the flags that saved it" in str(said)

"""The data half of the pretrain flow: preprocessing round trip and its errors, the tokenizers, the dataset
provider (blends, mock data), the data loader's orders, and get_batch across tensor and pipeline ranks."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from collections import Counter

import adapter  # noqa: F401  - before megatron
import numpy as np
import pytest
import torch
from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

from adapter.input_refusals import InputRefused, check_data
from scripts import preprocess_data, prepare_sample_data
from scripts.preprocess_data import build_tokenizer
from tests import data_ranks
from tests.distributed import ROOT, launch_script, run_ranks

CORPUS = prepare_sample_data.CORPUS


def _corpus_texts() -> list[str]:
    with open(CORPUS, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


@pytest.fixture(scope="module")
def sample_data(tmp_path_factory):
    """The demo's data, as scripts/prepare_sample_data.py makes it: (data prefix, tokenizer model)."""
    directory = tmp_path_factory.mktemp("sample-data")
    return prepare_sample_data.prepare(directory), str(directory / "tokenizer.model")


def _sp_args(model: str, **extra) -> argparse.Namespace:
    return argparse.Namespace(tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model=model, **extra)


def _write_jsonl(path, lines) -> str:
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


# ---------------------------------------------------------------- preprocessing
def test_sample_corpus_is_small_ascii_jsonl():
    texts = _corpus_texts()
    assert CORPUS.stat().st_size <= 1_500_000 and len(texts) > 400
    assert all(text and text.isascii() for text in texts)


def test_preprocess_round_trip_decodes_every_document_to_its_text(sample_data):
    prefix, model = sample_data
    tokenizer = build_tokenizer(_sp_args(model))
    assert tokenizer.vocab_size == 512
    dataset = IndexedDataset(prefix)
    texts = _corpus_texts()
    assert len(dataset) == len(texts)
    for i, text in enumerate(texts):
        ids = dataset[i].tolist()
        assert ids[-1] == tokenizer.eod and tokenizer.eod not in ids[:-1]
        assert tokenizer.detokenize(ids[:-1]) == text, f"document {i}"


def test_workers_write_the_same_files_as_one_process(sample_data, tmp_path):
    _, model = sample_data
    source = _write_jsonl(tmp_path / "part.jsonl", CORPUS.read_text().splitlines()[:60])
    common = ["--input", source, "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", model,
              "--append-eod", "--no-progress"]
    assert preprocess_data.main(common + ["--output-prefix", str(tmp_path / "one"), "--workers", "1"]) == 0
    assert preprocess_data.main(common + ["--output-prefix", str(tmp_path / "two"), "--workers", "2"]) == 0
    for suffix in (".bin", ".idx"):
        one = (tmp_path / f"one_text_document{suffix}").read_bytes()
        assert one == (tmp_path / f"two_text_document{suffix}").read_bytes()


def test_hugging_face_tokenizer_round_trip(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = _corpus_texts()[:20]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(tmp_path / "hf")
    source = _write_jsonl(tmp_path / "docs.jsonl", [json.dumps({"text": t}) for t in texts])
    assert preprocess_data.main(["--input", source, "--output-prefix", str(tmp_path / "hfdata"),
                                 "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                                 str(tmp_path / "hf"), "--append-eod", "--no-progress"]) == 0
    tokenizer = build_tokenizer(argparse.Namespace(tokenizer_type="HuggingFaceTokenizer",
                                                   tokenizer_model=str(tmp_path / "hf")))
    dataset = IndexedDataset(str(tmp_path / "hfdata_text_document"))
    for i, text in enumerate(texts):
        assert dataset[i][-1] == tokenizer.eod
        assert tokenizer.detokenize(dataset[i][:-1].tolist()) == text


@pytest.mark.parametrize("lines, message", [
    (['{"text": "fine"}', '{"text": "broken'], "docs.jsonl:2: not a JSON object"),
    (['{"text": "fine"}', '', '["a list"]'], "docs.jsonl:3: not a JSON object but list"),
    (['{"text": "fine"}', '{"body": "no text"}'], "docs.jsonl:2: no key 'text' (the line has: 'body')"),
    (['{"text": 7}'], "docs.jsonl:1: 'text' is a int, not a string"),
])
@pytest.mark.parametrize("workers", [1, 2])
def test_bad_input_is_one_error_line_and_leaves_no_files(sample_data, tmp_path, capsys, lines, message, workers):
    _, model = sample_data
    source = _write_jsonl(tmp_path / "docs.jsonl", lines)
    status = preprocess_data.main(["--input", source, "--output-prefix", str(tmp_path / "out" / "data"),
                                   "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", model,
                                   "--workers", str(workers), "--no-progress"])
    err = capsys.readouterr().err
    assert status == 2
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
    assert not any((tmp_path / "out").iterdir())


def test_cli_missing_input_exits_2_without_traceback(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "preprocess_data.py"),
                             "--input", str(tmp_path / "absent.jsonl"), "--output-prefix", str(tmp_path / "x"),
                             "--tokenizer-type", "NullTokenizer", "--vocab-size", "16"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr == f"error: --input '{tmp_path / 'absent.jsonl'}': no such file\n"  # nothing of torch's
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- tokenizers
@pytest.mark.parametrize("args, message", [
    (dict(tokenizer_type="GPT2BPE"), "--tokenizer-type 'GPT2BPE' is not supported; use one of: "),
    (dict(tokenizer_type="SentencePieceTokenizer", tokenizer_model="missing.model"),
     "--tokenizer-model 'missing.model' is not a file"),
    (dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=None), "--tokenizer-model None is not a directory"),
    (dict(tokenizer_type="NullTokenizer"), "--vocab-size None: NullTokenizer needs --vocab-size of at least 2"),
])
def test_bad_tokenizer_arguments_are_value_errors(args, message):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(".", r"\.")):
        build_tokenizer(argparse.Namespace(**args))


def test_corrupt_sentencepiece_model_is_a_value_error(tmp_path):
    (tmp_path / "bad.model").write_bytes(b"not a model")
    with pytest.raises(ValueError, match="could not be loaded as a GPTSentencePieceTokenizer"):
        build_tokenizer(_sp_args(str(tmp_path / "bad.model")))


def test_null_tokenizer_is_megatron_s_its_last_id_the_end_of_document():
    """The NullTokenizer megatron.training builds (megatron-core 0.19's): --vocab-size entries, the last the
    end-of-document id, so the corpus preprocessed is the one training reads."""
    tokenizer = build_tokenizer(argparse.Namespace(tokenizer_type="NullTokenizer", vocab_size=1000))
    assert (tokenizer.vocab_size, tokenizer.eod) == (1000, 999)
    assert tokenizer.detokenize(tokenizer.tokenize("3 1 4")) == "3 1 4"


# ---------------------------------------------------------------- datasets
def _megatron_args(monkeypatch, **fields) -> argparse.Namespace:
    """megatron.training's arguments (its parser's defaults) with ``fields``, as scripts/pretrain_gpt.py's run
    holds them."""
    from megatron.training.arguments import parse_args

    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py"])
    args = parse_args()
    vars(args).update(fields)
    return args


def _provided(monkeypatch, tokenizer, samples: list[int], **fields) -> tuple:
    """flow.gpt's dataset provider (scripts/pretrain_gpt.py's) on megatron.training's global arguments and
    tokenizer, without a process group: built on this process, its indices cached beside the data."""
    from megatron.training import global_vars

    from flow import gpt

    args = _megatron_args(monkeypatch, **{"split": "1,0,0", "seq_length": 16, "seed": 1234, "mock_data": False,
                                          "create_attention_mask_in_dataloader": False, **fields})
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", args)
    monkeypatch.setattr(global_vars, "_GLOBAL_TOKENIZER", tokenizer)
    monkeypatch.setattr(gpt, "is_dataset_built_on_rank", lambda vp_stage=None: True)
    return gpt.train_valid_test_datasets_provider(samples)


def test_blend_draws_samples_in_proportion_to_its_weights(tmp_path, monkeypatch):
    """Dataset A holds only token 1, dataset B only token 2: each sample tells where it came from."""
    tokenizer = build_tokenizer(argparse.Namespace(tokenizer_type="NullTokenizer", vocab_size=16))
    prefixes = []
    for name, token in (("a", 1), ("b", 2)):
        source = _write_jsonl(tmp_path / f"{name}.jsonl",
                              [json.dumps({"text": " ".join([str(token)] * 40)})] * 50)
        assert preprocess_data.main(["--input", source, "--output-prefix", str(tmp_path / name), "--tokenizer-type",
                                     "NullTokenizer", "--vocab-size", "16", "--append-eod", "--no-progress"]) == 0
        prefixes.append(str(tmp_path / f"{name}_text_document"))
    train, valid, test = _provided(monkeypatch, tokenizer, [2000, 0, 0],
                                   data_path=["0.3", prefixes[0], "0.7", prefixes[1]])
    assert isinstance(train, BlendedDataset) and valid is None and test is None
    sources = Counter(int(train[i]["tokens"][train[i]["tokens"] != tokenizer.eod][0]) for i in range(len(train)))
    assert len(train) >= 2000 and set(sources) == {1, 2}
    assert sources[1] / len(train) == pytest.approx(0.3, abs=0.02)


def test_single_dataset_splits_and_mock_data(sample_data, monkeypatch):
    prefix, model = sample_data
    tokenizer = build_tokenizer(_sp_args(model))
    train, valid, test = _provided(monkeypatch, tokenizer, [100, 10, 0], data_path=[prefix], split="90,10,0")
    assert isinstance(train, GPTDataset) and isinstance(valid, GPTDataset) and test is None
    assert train[0]["tokens"].shape == (16,) and "attention_mask" not in train[0]  # causal models never read it
    train, _, _ = _provided(monkeypatch, tokenizer, [100, 10, 0], data_path=[prefix], split="90,10,0",
                            create_attention_mask_in_dataloader=True)
    assert train[0]["attention_mask"].shape == (1, 16, 16)
    train, _, _ = _provided(monkeypatch, tokenizer, [100, 10, 0], mock_data=True)
    assert isinstance(train, MockGPTDataset)


# ---------------------------------------------------------------- the corpora checked before the first step
DOCUMENTS = [list(range(1, 11)), list(range(11, 23)), list(range(23, 31))]  # 30 tokens: 60 bytes as uint16
REWRITE = "write the .bin and .idx again together with scripts/preprocess_data.py"


def _corpus(directory, name: str, documents: list[list[int]] = DOCUMENTS, dtype=np.uint16) -> str:
    """A corpus written by megatron-core's own IndexedDatasetBuilder, the format's reference: its prefix."""
    prefix = str(directory / name)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for document in documents:
        builder.add_document(torch.tensor(document), [len(document)])
    builder.finalize(prefix + ".idx")
    return prefix


def _truncated_bin(directory, vocab: int) -> tuple[str, str]:
    prefix = _corpus(directory, "c")
    assert os.path.getsize(prefix + ".bin") == 60
    os.truncate(prefix + ".bin", 57)
    return prefix, (f"{prefix}.bin is 57 bytes, 3 short of the 60 its index {prefix}.idx describes: it is truncated "
                    f"(or the .idx is another corpus's); {REWRITE}")


def _another_corpus_idx(directory, vocab: int) -> tuple[str, str]:
    prefix, other = _corpus(directory, "c"), _corpus(directory, "d", [[5] * 20])  # 60 and 40 bytes of tokens
    shutil.copyfile(other + ".idx", prefix + ".idx")
    return prefix, (f"{prefix}.bin is 60 bytes, 20 more than the 40 its index {prefix}.idx describes: the .idx is "
                    f"another corpus's; {REWRITE}")


def _token_at_the_vocabulary(directory, vocab: int) -> tuple[str, str]:
    prefix = _corpus(directory, "c", [*DOCUMENTS, [1, vocab, 2]])
    return prefix, (f"{prefix}.bin holds token id {vocab}, outside the model's vocabulary of {vocab} (ids 0 to "
                    f"{vocab - 1}): it was tokenized with another tokenizer; preprocess it again with this run's "
                    "--tokenizer-type / --tokenizer-model / --vocab-size")


def _negative_token(directory, vocab: int) -> tuple[str, str]:
    prefix = _corpus(directory, "c", [*DOCUMENTS, [3, -1]], dtype=np.int32)  # preprocess_data's dtype above 65500
    return prefix, (f"{prefix}.bin holds token id -1, outside the model's vocabulary of {vocab} (ids 0 to "
                    f"{vocab - 1}): it was tokenized with another tokenizer; preprocess it again with this run's "
                    "--tokenizer-type / --tokenizer-model / --vocab-size")


def _not_an_index(directory, vocab: int) -> tuple[str, str]:
    prefix = _corpus(directory, "c")
    with open(prefix + ".idx", "wb") as f:
        f.write(b"PK\x03\x04 a zip, not an index")
    return prefix, f"{prefix}.idx is not a megatron index file (no MMIDIDX header); {REWRITE}"


def _truncated_idx(directory, vocab: int) -> tuple[str, str]:
    prefix = _corpus(directory, "c")
    size = os.path.getsize(prefix + ".idx")
    os.truncate(prefix + ".idx", size - 8)
    return prefix, (f"{prefix}.idx is {size - 8} bytes, short of the {size} its header announces (3 sequences, "
                    f"4 document boundaries): it is truncated; {REWRITE}")


FAULTS = {"truncated .bin": _truncated_bin, "another corpus's .idx": _another_corpus_idx,
          "token id = vocabulary": _token_at_the_vocabulary, "negative token id": _negative_token,
          "not an index": _not_an_index, "truncated .idx": _truncated_idx}


def _checked(monkeypatch, data_path: list[str], **fields) -> None:
    """The adapter's corpus check as scripts/pretrain_gpt.py runs it (patches/input_refusals.py, when
    megatron.training builds its data iterators): the embedding's 64 rows, no process group."""
    check_data(_megatron_args(monkeypatch, data_path=data_path, padded_vocab_size=64, **fields))


@pytest.mark.parametrize("fault", FAULTS)
def test_a_bad_corpus_is_refused_naming_the_file_the_fault_and_the_fix(tmp_path, fault, monkeypatch):
    prefix, message = FAULTS[fault](tmp_path, 64)
    with pytest.raises(InputRefused) as refused:
        _checked(monkeypatch, ["0.5", _corpus(tmp_path, "good"), "0.5", prefix])
    assert str(refused.value) == message


def test_a_clean_corpus_passes_and_the_token_scan_can_be_skipped(tmp_path, monkeypatch):
    """Ids up to the vocabulary's last (63) pass; check_token_ids False (the own flow's --no-check-token-ids)
    leaves a corpus with id 64 unread."""
    _checked(monkeypatch, [_corpus(tmp_path, "clean", [*DOCUMENTS, [63] * 40])])
    prefix, _ = _token_at_the_vocabulary(tmp_path, 64)
    _checked(monkeypatch, [prefix], check_token_ids=False)


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("fault", ["truncated .bin", "another corpus's .idx", "token id = vocabulary"])
def test_a_bad_corpus_stops_every_rank_before_the_first_step_with_one_error_line(tmp_path, fault):
    """scripts/pretrain_gpt.py (megatron.training's ``pretrain``) on 2 ranks: rank 0 checks the corpus as
    megatron builds its data iterators (adapter/input_refusals.py) and gives every rank its verdict: the job
    says it in one line (from one process) and every rank exits 2 (a refused input), none left waiting in a
    collective. The vocabulary is qwen2.5-tiny's 512 embedding rows, not the 64 of the tokenizer."""
    prefix, message = FAULTS[fault](tmp_path, 512)
    ranks = launch_script("scripts/pretrain_gpt.py", [
        "--model", "qwen2.5-tiny", "--micro-batch-size", "2", "--global-batch-size", "4", "--seq-length", "16",
        "--train-iters", "1", "--lr", "1e-3", "--eval-iters", "0", "--eval-interval", "1", "--tokenizer-type",
        "NullTokenizer", "--vocab-size", "63", "--data-path", prefix, "--split", "1,0,0",
        "--distributed-timeout-minutes", "1"])
    output = "".join(output for _, output in ranks)
    assert [status for status, _ in ranks] == [2, 2], output[-3000:]
    assert "Traceback" not in output and " iteration " not in output, output[-3000:]
    errors = [line for line in output.splitlines() if "error:" in line]
    assert errors == [f"error: {message}"], output[-3000:]


# ---------------------------------------------------------------- get_batch on ranks
@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("with_mask", [False, True], ids=["no-mask", "mask"])
def test_tensor_parallel_ranks_get_the_same_batch(sample_data, tmp_path, with_mask):
    """Rank 1 receives rank 0's batch into the shapes the arguments give, with no exchange of sizes; the
    [s, s] mask only where --create-attention-mask-in-dataloader asks for it."""
    prefix, model = sample_data
    results = run_ranks(2, data_ranks.batches_on_rank, 2, 1, prefix, model, str(tmp_path / "cache"), 3, with_mask)
    assert [r["has_dataset"] for r in results] == [True, False]
    for step, expected in enumerate(results[0]["expected_tokens"]):
        first, second = (r["batches"][step] for r in results)
        assert torch.equal(first[0], expected)
        for a, b in zip(first, second):
            assert (a is None and b is None) or (a.dtype == b.dtype and torch.equal(a, b))
        tokens, labels, loss_mask, attention_mask, position_ids = first
        if with_mask:
            assert attention_mask.dtype == torch.bool and attention_mask.shape == (2, 1, 32, 32)
            assert torch.equal(attention_mask[0, 0], torch.ones(32, 32, dtype=torch.bool).triu(1))
        else:
            assert attention_mask is None
        assert loss_mask.dtype == torch.float32 and position_ids.shape == tokens.shape == labels.shape == (2, 32)
        assert tokens.dtype == labels.dtype == position_ids.dtype == torch.int64


@pytest.mark.multiproc
@pytest.mark.slow
def test_middle_pipeline_stage_gets_no_batch(sample_data, tmp_path):
    prefix, model = sample_data
    results = run_ranks(3, data_ranks.batches_on_rank, 1, 3, prefix, model, str(tmp_path / "cache"), 1)
    by_stage = {r["pp_rank"]: r for r in results}
    assert [by_stage[s]["has_dataset"] for s in range(3)] == [True, False, True]
    assert by_stage[1]["batches"] == [(None,) * 5]
    # megatron's get_batch gives the first stage the tokens the embedding reads, the last the labels of the loss
    assert torch.equal(by_stage[0]["batches"][0][0], by_stage[0]["expected_tokens"][0])
    assert torch.equal(by_stage[2]["batches"][0][1], by_stage[2]["expected_labels"][0])

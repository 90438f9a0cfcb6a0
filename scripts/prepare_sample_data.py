"""Prepare the demo's data: a 512-piece sentencepiece model trained on the shipped sample corpus, and the corpus
tokenized with it into megatron's indexed dataset. Prints the data prefix (the only line on stdout).

    PREFIX=$(python scripts/prepare_sample_data.py sample-data)   # -> sample-data/sample_text_document
    ... --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model sample-data/tokenizer.model --data-path $PREFIX

The tokenizer is deterministic (BPE, one thread, the corpus in file order, fixed options), keeps the text as it is
(no normalization, spaces kept) and covers every character of the corpus, so each document decodes back to its
exact text. A few seconds on two cores.
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # runnable from a checkout

from scripts import preprocess_data  # noqa: E402

CORPUS = ROOT / "scripts" / "data" / "sample_corpus.jsonl"
VOCAB_SIZE = 512
TOKENIZER_TYPE = "GPTSentencePieceTokenizer"


def train_sentencepiece(corpus: Path, model_path: Path, vocab_size: int = VOCAB_SIZE) -> Path:
    """A BPE model over the corpus's lines of text; a newline is a piece of its own, since documents keep their
    paragraph breaks and sentencepiece never sees one inside a training sentence."""
    import sentencepiece

    with open(corpus, encoding="utf-8") as f:
        sentences = [line for record in f for line in json.loads(record)["text"].split("\n")]
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences), model_writer=model, vocab_size=vocab_size, model_type="bpe",
        character_coverage=1.0, normalization_rule_name="identity", remove_extra_whitespaces=False,
        user_defined_symbols=["\n"], input_sentence_size=len(sentences), shuffle_input_sentence=False,
        max_sentence_length=1 << 16, num_threads=1, minloglevel=2)
    model_path.parent.mkdir(parents=True, exist_ok=True)
    partial = model_path.with_name(model_path.name + ".tmp")
    partial.write_bytes(model.getvalue())
    partial.replace(model_path)
    return model_path


def prepare(output_dir: Path, workers: int = 1) -> str:
    """Tokenizer and dataset in ``output_dir``; returns the data prefix."""
    model = train_sentencepiece(CORPUS, output_dir / "tokenizer.model")
    prefix = output_dir / "sample"
    status = preprocess_data.main(["--input", str(CORPUS), "--output-prefix", str(prefix),
                                   "--tokenizer-type", TOKENIZER_TYPE, "--tokenizer-model", str(model),
                                   "--append-eod", "--workers", str(workers), "--no-progress"])
    if status:
        raise SystemExit(status)
    # GPTDataset caches its sample indices beside the data; they describe the old files, not these
    shutil.rmtree(output_dir / "cache", ignore_errors=True)
    return preprocess_data.output_prefix(str(prefix), "text")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output_dir", nargs="?", type=Path, default=Path("sample-data"),
                        help="where the tokenizer and dataset go (default: ./sample-data)")
    parser.add_argument("--workers", type=int, default=1, help="tokenizing processes (default 1: the corpus is small)")
    args = parser.parse_args(argv)
    print(prepare(args.output_dir, args.workers))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Tokenize a jsonl corpus into megatron's indexed dataset (.bin/.idx), as Megatron-LM's tools/preprocess_data.py.

    python scripts/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model tokenizer.model --append-eod --workers 2

Each line of the input is one JSON object, one document; each key in --json-keys (default: text) becomes its own
dataset, ``{output_prefix}_{key}_document.bin/.idx``, written by megatron-core's IndexedDatasetBuilder so that
GPTDataset reads it (pass ``--data-path {output_prefix}_{key}_document`` to training). Bad input (a missing file,
a line that is not a JSON object, a missing key) is one ``error:`` line and exit status 2; outputs are written
under temporary names and renamed when complete, so a failed run leaves none behind.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runnable from a checkout
os.environ.setdefault("ADAPTER_BACKEND", "cpu")  # tokenizing never needs an accelerator

import adapter  # noqa: E402,F401 - before megatron: its warning filters (adapter.quiet_warnings) are in time
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder  # noqa: E402
from tqdm import tqdm  # noqa: E402

from adapter.input_refusals import flag_defaults  # noqa: E402 - megatron's parser defaults, as training reads them


_TOKENIZER = None  # each worker process's own
# the tokenizers this script takes (megatron's other types need vocabulary files or a hub), by the file they read
TOKENIZER_FILES = {"SentencePieceTokenizer": "file", "GPTSentencePieceTokenizer": "file", "Llama2Tokenizer": "file",
                   "HuggingFaceTokenizer": "directory", "NullTokenizer": None}


class InputError(ValueError):
    """Bad input, reported as one line without a traceback."""


def output_prefix(prefix: str, key: str) -> str:
    """The dataset prefix for one json key, as training's --data-path names it."""
    return f"{prefix}_{key}_document"


def _tokenizer_args(args: argparse.Namespace) -> argparse.Namespace:
    return argparse.Namespace(tokenizer_type=args.tokenizer_type, tokenizer_model=args.tokenizer_model,
                              vocab_size=args.vocab_size)


def build_tokenizer(args: argparse.Namespace):
    """The tokenizer megatron.training builds for ``args`` (megatron-core's ``build_tokenizer``), so the
    ids written are the ones training reads: megatron's NullTokenizer holds --vocab-size entries, the last the
    end-of-document id. A bad type, path or model is a ValueError naming the value and the fix; nothing is
    fetched from a hub."""
    if args.tokenizer_type not in TOKENIZER_FILES:
        raise ValueError(f"--tokenizer-type {args.tokenizer_type!r} is not supported; use one of: "
                         + ", ".join(TOKENIZER_FILES))
    kind, path = TOKENIZER_FILES[args.tokenizer_type], getattr(args, "tokenizer_model", None)
    if kind == "file" and not (path and os.path.isfile(path)):
        raise ValueError(f"--tokenizer-model {path!r} is not a file: {args.tokenizer_type} needs a sentencepiece "
                         ".model file (scripts/prepare_sample_data.py trains a small one)")
    if kind == "directory" and not (path and os.path.isdir(path)):
        raise ValueError(f"--tokenizer-model {path!r} is not a directory: HuggingFaceTokenizer needs a local "
                         "Hugging Face tokenizer directory (tokenizer.json / tokenizer_config.json); download it first")
    size = getattr(args, "vocab_size", None)
    if kind is None and not (isinstance(size, int) and size > 1):
        raise ValueError(f"--vocab-size {size!r}: NullTokenizer needs --vocab-size of at least 2 (the last id is "
                         "the end-of-document token)")
    try:  # megatron-core 0.17+; 0.16.1 trains with a Megatron-LM checkout's tokenizer, not this one
        from megatron.core.tokenizers.utils import build_tokenizer as megatron_tokenizers
    except ImportError:
        raise ValueError("this megatron-core has no megatron.core.tokenizers.utils (0.16.1): scripts/"
                         "preprocess_data.py writes the ids of megatron-core 0.17+'s tokenizers; use Megatron-LM's "
                         "tools/preprocess_data.py from the core_v0.16.1 checkout") from None
    try:
        # ids only: 0.19 pads the embedding's rows only when asked; 0.17 works them out always (as rank 0) and
        # logs them, which is training's notice, not this script's (its stdout is read: prepare_sample_data.py)
        given = {**flag_defaults(), "pad_vocab_size": False, "rank": 0, **vars(args)}
        notices = logging.getLogger("megatron.core.tokenizers")
        level = notices.level
        notices.setLevel(logging.WARNING)
        try:
            return megatron_tokenizers.build_tokenizer(argparse.Namespace(**given))
        finally:
            notices.setLevel(level)
    except (RuntimeError, OSError, ValueError) as exc:
        raise ValueError(f"--tokenizer-model {path!r} could not be loaded as a {args.tokenizer_type} "
                         f"({exc}); pass a valid model for that type") from exc


def _start_worker(tokenizer_args: argparse.Namespace) -> None:
    global _TOKENIZER
    _TOKENIZER = build_tokenizer(tokenizer_args)


def _encode(job):
    """One jsonl line -> (its size in bytes, {key: token ids}); runs in a worker."""
    (number, raw), keys, append_eod, source = job
    try:
        record = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{source}:{number}: not a JSON object ({exc})") from None
    if not isinstance(record, dict):
        raise InputError(f"{source}:{number}: not a JSON object but {type(record).__name__}")
    encoded = {}
    for key in keys:
        if key not in record:
            raise InputError(f"{source}:{number}: no key {key!r} (the line has: {', '.join(map(repr, record))}); "
                             "choose the keys with --json-keys")
        if not isinstance(record[key], str):
            raise InputError(f"{source}:{number}: {key!r} is a {type(record[key]).__name__}, not a string")
        ids = list(_TOKENIZER.tokenize(record[key]))
        encoded[key] = ids + [_TOKENIZER.eod] if append_eod else ids
    return len(raw), encoded


def _jobs(path: Path, args: argparse.Namespace):
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if raw.strip():
                yield (number, raw), args.json_keys, args.append_eod, str(path)


class _Outputs:
    """One IndexedDatasetBuilder per key, writing to temporary names until ``commit``."""

    def __init__(self, prefix: str, keys: list[str], vocab_size: int):
        self.final = {key: output_prefix(prefix, key) for key in keys}
        self.temp = {key: f"{final}.tmp{os.getpid()}" for key, final in self.final.items()}
        self.builders = {}
        dtype = DType.optimal_dtype(vocab_size)
        for key, temp in self.temp.items():
            Path(temp).parent.mkdir(parents=True, exist_ok=True)
            self.builders[key] = IndexedDatasetBuilder(temp + ".bin", dtype=dtype)
        self.documents = 0
        self.tokens = dict.fromkeys(keys, 0)

    def add(self, encoded: dict) -> None:
        if not any(encoded.values()):
            return  # an empty document (no text, no EOD) adds nothing a sample could hold
        for key, ids in encoded.items():
            self.builders[key].add_document(ids, [len(ids)])
            self.tokens[key] += len(ids)
        self.documents += 1

    def commit(self) -> None:
        for key, builder in self.builders.items():
            builder.finalize(self.temp[key] + ".idx")
        for key, temp in self.temp.items():
            os.replace(temp + ".bin", self.final[key] + ".bin")
            os.replace(temp + ".idx", self.final[key] + ".idx")

    def discard(self) -> None:
        for key, builder in self.builders.items():
            builder.data_file.close()
            for suffix in (".bin", ".idx"):
                Path(self.temp[key] + suffix).unlink(missing_ok=True)


def _encoded_lines(args: argparse.Namespace, pool):
    jobs = _jobs(args.input, args)
    return pool.imap(_encode, jobs, chunksize=16) if pool else map(_encode, jobs)


def preprocess(args: argparse.Namespace) -> _Outputs:
    """Tokenize ``args.input`` into the datasets of ``args.output_prefix``; raises InputError or ValueError."""
    if not args.input.is_file():
        raise InputError(f"--input {str(args.input)!r}: no such file")
    tokenizer_args = _tokenizer_args(args)
    _start_worker(tokenizer_args)  # here first, so a bad tokenizer fails once, before any worker starts
    outputs = _Outputs(args.output_prefix, args.json_keys, _TOKENIZER.vocab_size)
    pool = None
    try:
        if args.workers > 1:
            pool = multiprocessing.Pool(args.workers, _start_worker, (tokenizer_args,))
        with tqdm(total=args.input.stat().st_size, unit="B", unit_scale=True, desc=args.input.name,
                  disable=args.no_progress) as bar:
            unshown = 0
            for number, (size, encoded) in enumerate(_encoded_lines(args, pool), 1):
                outputs.add(encoded)
                unshown += size
                if number % args.log_interval == 0:
                    bar.update(unshown)
                    unshown = 0
            bar.update(unshown)
        outputs.commit()
    except BaseException:
        outputs.discard()
        raise
    finally:
        if pool:
            pool.terminate()
    return outputs


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", type=Path, required=True, help="jsonl file, one document per line")
    parser.add_argument("--output-prefix", required=True, help="writes {prefix}_{key}_document.bin/.idx")
    parser.add_argument("--json-keys", nargs="+", default=["text"], help="keys to tokenize (default: text)")
    parser.add_argument("--tokenizer-type", required=True, metavar="TYPE",
                        help="one of: " + ", ".join(TOKENIZER_FILES))
    parser.add_argument("--tokenizer-model", help="sentencepiece .model file or Hugging Face tokenizer directory")
    parser.add_argument("--vocab-size", type=int,
                        help="NullTokenizer's vocabulary size, the end-of-document id its last (megatron's)")
    parser.add_argument("--append-eod", action="store_true", help="end every document with the EOD token")
    parser.add_argument("--workers", type=int, default=1, help="tokenizing processes (default 1)")
    parser.add_argument("--log-interval", type=int, default=100,
                        help="advance the progress bar every this many documents (default 100)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.workers < 1 or args.log_interval < 1:
        parser.error("--workers and --log-interval must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        outputs = preprocess(args)
    except ValueError as exc:  # InputError, and the tokenizer's errors
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for key, prefix in outputs.final.items():
        print(f"{args.input}: {outputs.documents} documents, {outputs.tokens[key]} tokens -> {prefix}.bin/.idx",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

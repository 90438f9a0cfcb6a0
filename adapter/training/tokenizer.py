"""The tokenizer named by Megatron-LM's ``--tokenizer-type`` / ``--tokenizer-model``, built from megatron-core's own
tokenizer classes (``megatron.core.tokenizers``), which give GPTDataset what it reads: ``eod``, ``vocab_size``,
``tokenize``, ``detokenize`` and ``unique_identifiers``.

The sentencepiece types all map to megatron-core's sentencepiece library in its non-legacy mode: the vocabulary
is the model's own (no special tokens appended, as Megatron-LM's legacy ``SentencePieceTokenizer`` did) and the
end-of-document token is the model's ``</s>``. So a 512-piece model trains a model whose vocabulary is 512.
"""

from __future__ import annotations

import argparse
import os

from megatron.core.tokenizers import MegatronTokenizer

SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
LIBRARIES = {**{name: "sentencepiece" for name in SENTENCEPIECE_TYPES},
             "HuggingFaceTokenizer": "huggingface", "NullTokenizer": "null"}


def build_tokenizer(args: argparse.Namespace):
    """The tokenizer for ``args``. Any bad type, path or size is a ValueError naming the value and the fix.
    Unlike Megatron-LM's, it leaves ``args.padded_vocab_size`` alone: the pretrain flow sets that, since a
    named model's embedding size is fixed by the model."""
    library = _library(args.tokenizer_type)
    if library == "null":
        tokenizer = _null_tokenizer(args)
    else:
        tokenizer = _load(library, _model_path(args, library), args)
    if tokenizer.eod is None or tokenizer.eod < 0:
        raise ValueError(f"--tokenizer-model {args.tokenizer_model!r} has no end-of-document token (eos): "
                         "GPT datasets need one; use a tokenizer that defines it")
    return tokenizer


def _library(tokenizer_type) -> str:
    if tokenizer_type not in LIBRARIES:
        raise ValueError(f"--tokenizer-type {tokenizer_type!r} is not supported; use one of: "
                         + ", ".join(LIBRARIES))
    return LIBRARIES[tokenizer_type]


def _model_path(args: argparse.Namespace, library: str) -> str:
    """The local tokenizer path: nothing is fetched from a hub, so a mistyped path is an error here rather than a
    download attempt."""
    path = getattr(args, "tokenizer_model", None)
    if library == "sentencepiece":
        if not path or not os.path.isfile(path):
            raise ValueError(f"--tokenizer-model {path!r} is not a file: {args.tokenizer_type} needs a sentencepiece "
                             ".model file (scripts/prepare_sample_data.py trains a small one)")
    elif not path or not os.path.isdir(path):
        raise ValueError(f"--tokenizer-model {path!r} is not a directory: HuggingFaceTokenizer needs a local "
                         "Hugging Face tokenizer directory (tokenizer.json / tokenizer_config.json); download it first")
    return path


def _load(library: str, path: str, args: argparse.Namespace):
    kwargs = {}
    if library == "huggingface":
        kwargs = {"use_fast": getattr(args, "tokenizer_hf_use_fast", True),
                  "trust_remote_code": getattr(args, "trust_remote_code", False)}
    try:
        return MegatronTokenizer.from_pretrained(tokenizer_path=path, metadata_path={"library": library}, **kwargs)
    except (RuntimeError, OSError, ValueError) as exc:
        raise ValueError(f"--tokenizer-model {path!r} could not be loaded as a {args.tokenizer_type} "
                         f"({exc}); pass a valid model for that type") from exc


def _null_tokenizer(args: argparse.Namespace):
    size = getattr(args, "vocab_size", None)
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"--vocab-size {size!r}: NullTokenizer needs a positive --vocab-size (without the "
                         "end-of-document token, which it adds)")
    return NullTokenizer(size)


class NullTokenizer:
    """Token ids written as numbers ("3 1 4"), for benchmarks and mock data: ids below ``vocab_size`` as
    the text says, and the end-of-document id ``vocab_size`` after them, so the vocabulary holds
    ``vocab_size + 1`` entries (Megatron-LM's NullTokenizer, same ids).

    The flow's own rather than megatron-core's: importing any of megatron-core's text tokenizers imports
    its Hugging Face one, and with it transformers where installed, a few seconds of every mock-data
    launch spent on a tokenizer that reads numbers."""

    def __init__(self, vocab_size: int):
        self.eod = vocab_size
        self.vocab_size = vocab_size + 1

    def tokenize(self, text: str) -> list[int]:
        return [int(token) for token in text.split()]

    def detokenize(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)

    @property
    def unique_identifiers(self) -> dict:
        """What megatron's datasets hash into their cache names."""
        return {"class": f"{type(self).__module__}.{type(self).__qualname__}", "vocab_size": self.vocab_size}

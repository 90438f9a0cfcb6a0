"""megatron-core's null tokenizer built without importing transformers (adapter/tokenizer_imports.py)."""

from __future__ import annotations

import functools

from adapter import tokenizer_imports


def null_library_alone(from_pretrained):
    """``MegatronTokenizer.from_pretrained``; for the null text tokenizer, its library module imported alone
    first, so megatron's lookup of the class finds it without the package's ``__init__``."""

    @functools.wraps(from_pretrained)
    def build(*args, **kwargs):
        metadata = kwargs.get("metadata_path", args[1] if len(args) > 1 else None)
        if isinstance(metadata, dict) and metadata.get("library") == "null-text":
            tokenizer_imports.import_null_library()
        return from_pretrained(*args, **kwargs)

    return build


def register(registry, versions: str) -> None:
    registry.wrap("megatron.core.tokenizers.megatron_tokenizer:MegatronTokenizer.from_pretrained",
                  null_library_alone, versions=versions, optional=True,
                  reason="--tokenizer-type NullTokenizer builds without importing transformers (1 s of start-up)")

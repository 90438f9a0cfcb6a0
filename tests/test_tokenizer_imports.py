"""megatron-core's null tokenizer, built through megatron's own ``build_tokenizer`` with the adapter, imports
no Hugging Face code, and megatron-core's tokenizer libraries package still gives every name it gives without
the adapter, the very objects its modules define (adapter/tokenizer_imports.py). Each in a fresh interpreter:
what is imported is the point."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.distributed import ROOT

pytestmark = pytest.mark.megatron_training  # megatron-core 0.17+: build_tokenizer's null library is "null-text"

BUILD = """
    import argparse, json, sys
    {imports}
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    tokenizer = build_tokenizer(argparse.Namespace(  # what megatron.training's arguments give it, of 0.17-0.19
        tokenizer_type="NullTokenizer", vocab_size=500, pad_vocab_size=True, make_vocab_size_divisible_by=128,
        tensor_model_parallel_size=1, rank=0, metadata_path=None))
    built = dict(transformers="transformers" in sys.modules, vocab_size=tokenizer.vocab_size, eod=tokenizer.eod,
                 ids=tokenizer.tokenize("7 1 499"), text=tokenizer.detokenize([3, 4]),
                 library=type(tokenizer._tokenizer).__module__)
    import megatron.core.tokenizers.text.libraries as libraries
    classes = {{name: getattr(libraries, name) for name in dir(libraries)
               if isinstance(getattr(libraries, name), type)}}
    names = {{name: f"{{value.__module__}}.{{value.__qualname__}}" for name, value in classes.items()}}
    same = all(getattr(sys.modules[value.__module__], value.__name__) is value for value in classes.values())
    print(json.dumps(dict(built=built, names=names, same=same, transformers="transformers" in sys.modules)))
"""


def _build(imports: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ADAPTER_BACKEND": "cpu"}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(BUILD.format(imports=imports))], env=env,
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def builds() -> tuple[dict, dict]:
    """Without the adapter, and with it."""
    return _build(""), _build("import adapter")


def test_the_null_tokenizer_builds_as_without_the_adapter_importing_no_hugging_face_code(builds):
    plain, adapted = builds
    assert plain["built"]["transformers"], "megatron-core imports transformers for it without the adapter"
    assert not adapted["built"]["transformers"]
    assert {**adapted["built"], "transformers": True} == plain["built"]


def test_the_tokenizer_libraries_package_gives_every_name_it_gives_without_the_adapter_after_a_null_tokenizer(builds):
    plain, adapted = builds
    assert adapted["names"] == plain["names"] and "HuggingFaceTokenizer" in adapted["names"]
    assert adapted["same"] and adapted["transformers"]

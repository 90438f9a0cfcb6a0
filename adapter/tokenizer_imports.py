"""The null tokenizer (``--tokenizer-type NullTokenizer``, what ``--mock-data`` runs take) built without
importing transformers.

megatron-core keeps every text tokenizer library in one package, ``megatron.core.tokenizers.text.libraries``, whose
``__init__`` imports them all, the Hugging Face ones among them: transformers, huggingface_hub and jinja2 for a
tokenizer that splits on spaces (about 1 s of a tiny run's start-up; tests/test_pretrain.py). Python runs a
package's ``__init__`` before any module in it, so the one way to the null library's module alone is to have the
package in ``sys.modules`` with its ``__init__`` not yet run, as the lazy-loading packages of scientific Python do
(SPEC 1): its modules import as usual, a name the imported modules already define (``NullTokenizer``, looked up by
megatron's ``getattr`` on the package) is answered from them, and any other name (or ``dir()``) runs the real
``__init__`` first, so ``from ...libraries import HuggingFaceTokenizer`` gets what it always got, the same objects;
only ``vars()`` of the package shows less until then. Done only where the null tokenizer is the first tokenizer
built; nothing changes once the package is imported.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys

TEXT = "megatron.core.tokenizers.text"
LIBRARIES = f"{TEXT}.libraries"
NULL_LIBRARY = f"{LIBRARIES}.null_tokenizer"


def import_null_library() -> None:
    """Import megatron-core's null tokenizer module without its package's ``__init__``, where neither is
    imported yet."""
    if LIBRARIES not in sys.modules and TEXT not in sys.modules:
        _defer_init(LIBRARIES, importlib.util.find_spec(TEXT).submodule_search_locations)
    importlib.import_module(NULL_LIBRARY)


def _defer_init(name: str, parent_path: list[str]) -> None:
    """Put package ``name`` (in ``parent_path``) in ``sys.modules`` with its ``__init__`` run at the first name
    asked of it that no imported module of it defines."""
    spec = importlib.machinery.PathFinder.find_spec(name, parent_path)
    package = importlib.util.module_from_spec(spec)

    def run_init() -> None:
        del package.__getattr__, package.__dir__
        spec.loader.exec_module(package)

    def __getattr__(attr: str):
        for module in [m for key, m in sys.modules.items() if key.startswith(f"{name}.")]:
            if attr in vars(module) and getattr(vars(module)[attr], "__module__", None) == module.__name__:
                return vars(module)[attr]
        run_init()
        return getattr(package, attr)

    def __dir__() -> list[str]:
        run_init()
        return dir(package)

    package.__getattr__, package.__dir__ = __getattr__, __dir__
    sys.modules[name] = package

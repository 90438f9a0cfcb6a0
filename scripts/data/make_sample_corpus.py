"""Regenerate sample_corpus.jsonl, the small English corpus the CPU demo trains on.

    python scripts/data/make_sample_corpus.py            # writes scripts/data/sample_corpus.jsonl

The text is the prose of Python's own documentation as the interpreter ships it (PSF License): the Language
Reference topics that ``pydoc`` serves (``pydoc_data.topics``), then the docstrings of the standard library
modules. Only prose paragraphs are kept (no code, doctests, tables or indented lists), each reflowed onto one
line; a document is one topic or one module, its paragraphs separated by newlines. The interpreter's licence
text is copied beside it as LICENSE-PSF.txt, as the PSF License asks of derived works. The corpus is ASCII so that a
512-piece sentencepiece model covers every character and decodes every document back exactly. The output depends
only on the Python version that runs this script (the shipped file was made with CPython 3.11.7).
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import re
import shutil
import sys
import sysconfig
import warnings
from pathlib import Path

DEFAULT_OUTPUT = Path(__file__).resolve().parent / "sample_corpus.jsonl"
STDLIB = Path(sysconfig.get_paths()["stdlib"])
MAX_BYTES = 1_400_000
MIN_WORDS = 8
# tests, tools, demos and vendored or platform packages: little prose, or not documentation of the library
SKIPPED_DIRS = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "ensurepip", "pydoc_data", "site-packages",
                "dist-packages", "__pycache__"}


def prose(text: str, seen: set[str]) -> list[str]:
    """The paragraphs of ``text`` that read as sentences, reflowed, each kept once across the corpus: the same
    docstring is often repeated on many methods."""
    kept = []
    for paragraph in re.split(r"\n\s*\n", inspect.cleandoc(text)):
        lines = paragraph.splitlines()
        if any(line[:1].isspace() for line in lines) or ">>>" in paragraph or "::" in paragraph:
            continue
        flat = " ".join(paragraph.split())
        if flat.isascii() and flat.endswith(".") and len(flat.split()) >= MIN_WORDS and flat not in seen:
            seen.add(flat)
            kept.append(flat)
    return kept


def reference_topics():
    """The Language Reference sections, as ``help('topic')`` shows them."""
    from pydoc_data.topics import topics

    for name in sorted(topics):
        yield topics[name]


def module_docstrings():
    """Each standard library module's docstrings, module first, then its classes and functions in source order;
    read with ``ast`` so that no module is imported (some act on import)."""
    for path in sorted(STDLIB.rglob("*.py")):
        folders = path.relative_to(STDLIB).parts[:-1]
        if SKIPPED_DIRS.intersection(folders) or any(part.startswith("config-") for part in folders):
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escape sequences in old modules
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        nodes = [n for n in ast.walk(tree)
                 if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
        nodes.sort(key=lambda n: getattr(n, "lineno", 0))
        yield "\n\n".join(doc for doc in map(ast.get_docstring, nodes) if doc)


def documents(max_bytes: int = MAX_BYTES) -> list[str]:
    seen: set[str] = set()
    docs, size = [], 0
    for source in (reference_topics(), module_docstrings()):
        for text in source:
            doc = "\n".join(prose(text, seen))
            if not doc:
                continue
            line_bytes = len(json.dumps({"text": doc})) + 1
            if size + line_bytes > max_bytes:
                return docs
            docs.append(doc)
            size += line_bytes
    return docs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="jsonl file to write")
    parser.add_argument("--max-bytes", type=int, default=MAX_BYTES, help="size limit of the jsonl file")
    args = parser.parse_args(argv)
    licence = STDLIB / "LICENSE.txt"
    if not licence.is_file():
        print(f"error: {licence} not found: the corpus must ship with this Python's licence text", file=sys.stderr)
        return 1
    docs = documents(args.max_bytes)
    args.output.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in docs), encoding="ascii")
    shutil.copyfile(licence, args.output.with_name("LICENSE-PSF.txt"))
    print(f"wrote {len(docs)} documents, {args.output.stat().st_size} bytes to {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

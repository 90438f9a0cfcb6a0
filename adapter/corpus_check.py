"""A corpus checked before the first step: a bad file stops the run at its start with one line naming the file,
the fault and the fix, not at the iteration whose sample first reads the bad part. It runs where
megatron.training builds its data iterators (patches/input_refusals.py), decided on rank 0 for every rank.

A corpus is two files that scripts/preprocess_data.py writes together (megatron-core's indexed dataset,
``megatron/core/datasets/indexed_dataset.py``): PREFIX.idx, a header (magic ``MMIDIDX\\0\\0``, version 1, the
token dtype's code, the sequence and document counts) then the sequences' lengths (int32), their byte offsets
into the .bin (int64, cumulative) and the document boundaries (int64); PREFIX.bin, the tokens back to back.
megatron trusts both: a missing pair fails inside its builder with a bare assertion, a .bin cut short by a
failed copy, or an .idx from another corpus, reads past the end or the wrong tokens when a sample reaches that
part, and a token id at or above the vocabulary fails in the embedding lookup of that sample's step, hours in:

- both files are there (``check_files``);
- the .idx header reads and the .idx holds the arrays it announces (``read_index``);
- the .bin ends exactly where the index's last sequence ends: shorter is truncated, longer is not the
  corpus the index describes;
- every token id is within the vocabulary the run's embedding has (``largest_token_id``).
"""

from __future__ import annotations

import dataclasses
import os
import struct

import numpy as np

_MAGIC = b"MMIDIDX\x00\x00"
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count
_BLOCK_BYTES = 64 << 20
_REWRITE = "write the .bin and .idx again together with scripts/preprocess_data.py"


class DataError(ValueError):
    """A corpus file the run cannot train on: names the file, the fault and the fix."""


def check_files(prefix: str, flag: str = "--data-path") -> None:
    """Refuse a ``prefix`` (given as ``flag``) whose .bin or .idx is not there, naming both the missing files
    and what writes them."""
    missing = [prefix + suffix for suffix in (".bin", ".idx") if not os.path.isfile(prefix + suffix)]
    if missing:
        raise DataError(f"{flag} {prefix}: {' and '.join(missing)} not found; pass the prefix "
                        "scripts/preprocess_data.py wrote (without .bin/.idx)")


@dataclasses.dataclass(frozen=True)
class Index:
    dtype: np.dtype  # of the tokens in the .bin
    end: int  # the .bin's size the index describes: where its last sequence ends


def read_index(idx_path: str) -> Index:
    """The header of an .idx and where its last sequence ends, from a few bytes: the arrays' sizes follow from
    the counts, and the last sequence's length and offset sit at known places."""
    with open(idx_path, "rb") as f:
        raw = f.read(_HEADER.size)
        if len(raw) < _HEADER.size or not raw.startswith(_MAGIC):
            raise DataError(f"{idx_path} is not a megatron index file (no MMIDIDX header); {_REWRITE}")
        _, version, code, sequences, documents = _HEADER.unpack(raw)
        dtype = _token_dtype(idx_path, version, code)
        needed = _HEADER.size + 12 * sequences + 8 * documents
        size = os.fstat(f.fileno()).st_size
        if size < needed:
            raise DataError(f"{idx_path} is {size} bytes, short of the {needed} its header announces ({sequences} "
                            f"sequences, {documents} document boundaries): it is truncated; {_REWRITE}")
        if sequences == 0:
            raise DataError(f"{idx_path} holds no sequences; preprocess an input that has documents")
        f.seek(_HEADER.size + 4 * (sequences - 1))
        (length,) = struct.unpack("<i", f.read(4))
        f.seek(_HEADER.size + 4 * sequences + 8 * (sequences - 1))
        (offset,) = struct.unpack("<q", f.read(8))
    return Index(dtype, offset + length * dtype.itemsize)


def _token_dtype(idx_path: str, version: int, code: int) -> np.dtype:
    """The tokens' dtype from the header's code: an integer one, in the only version megatron reads. megatron is
    imported here, not at the top: ``import adapter`` registers the patch table, which imports this module,
    and must import no megatron module before its CUDA routing is in place."""
    from megatron.core.datasets.indexed_dataset import DType

    if version != 1:
        raise DataError(f"{idx_path} is index version {version}; megatron reads version 1: {_REWRITE}")
    try:
        dtype = np.dtype(DType.dtype_from_code(code))
    except ValueError:
        raise DataError(f"{idx_path} names token dtype code {code}, which megatron does not know; {_REWRITE}") from None
    if dtype.kind not in "iu":
        raise DataError(f"{idx_path} says its tokens are {dtype}, not integer ids; {_REWRITE}")
    return dtype


def largest_token_id(bin_path: str, dtype: np.dtype) -> int:
    """The .bin's largest token id, or a negative one where there is one.

    One sequential pass over the file through a memmap, 64 MiB at a time (the memory is one block). The time
    is the read: seconds for gigabytes, about ten minutes per terabyte at 2 GB/s. The tokens are read as
    unsigned integers of their size, so that a negative id (int32 files hold them) is a huge one: one
    maximum per block finds both kinds of bad id."""
    unsigned = np.dtype(f"u{dtype.itemsize}")
    tokens = np.memmap(bin_path, dtype=unsigned, mode="r")
    step = _BLOCK_BYTES // unsigned.itemsize
    largest = max(int(tokens[start:start + step].max()) for start in range(0, tokens.size, step))
    return np.asarray(largest, unsigned).view(dtype).item()


def check_corpus(prefix: str, vocab_size: int, scan_tokens: bool = True) -> None:
    """Refuse, with a ``DataError`` naming the file, the fault and the fix, a corpus whose .idx does not read,
    whose .bin is not the size its .idx describes, or (``scan_tokens``) which holds a token id outside
    [0, ``vocab_size``)."""
    index = read_index(prefix + ".idx")
    bin_path = prefix + ".bin"
    size = os.path.getsize(bin_path)
    if size < index.end:
        raise DataError(f"{bin_path} is {size} bytes, {index.end - size} short of the {index.end} its index "
                        f"{prefix}.idx describes: it is truncated (or the .idx is another corpus's); {_REWRITE}")
    if size > index.end:
        raise DataError(f"{bin_path} is {size} bytes, {size - index.end} more than the {index.end} its index "
                        f"{prefix}.idx describes: the .idx is another corpus's; {_REWRITE}")
    if not scan_tokens:
        return
    token = largest_token_id(bin_path, index.dtype)
    if not 0 <= token < vocab_size:
        raise DataError(f"{bin_path} holds token id {token}, outside the model's vocabulary of {vocab_size} (ids 0 "
                        f"to {vocab_size - 1}): it was tokenized with another tokenizer; preprocess it again with "
                        "this run's --tokenizer-type / --tokenizer-model / --vocab-size")

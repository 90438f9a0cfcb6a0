"""Checkpoints with a payload in one pickled part, as a crafted download would have (issue 51): unpickling the
part runs ``touch FLAG`` and then gives the genuine value, so without an allow-list the load goes on as if
nothing happened and only the flag file shows that code ran."""

from __future__ import annotations

import dataclasses
import io
import operator
import os
import pickle
from pathlib import Path

import torch


class _Touch:
    def __init__(self, flag: Path):
        self.flag = flag

    def __reduce__(self):
        return os.system, (f"touch {self.flag}",)


class _ThenGenuine:
    """Unpickles to ``genuine`` after running ``touch flag`` (operator.getitem((os.system(...), genuine), 1))."""

    def __init__(self, flag: Path, genuine):
        self.flag, self.genuine = flag, genuine

    def __reduce__(self):
        return operator.getitem, ((_Touch(self.flag), self.genuine), 1)


def _read_metadata(directory: Path):
    with open(directory / ".metadata", "rb") as file:
        return pickle.load(file)  # the test's own genuine checkpoint


def in_metadata(directory: Path, flag: Path) -> None:
    """torch DCP's ``.metadata`` of ``directory`` replaced by the payload."""
    genuine = _read_metadata(directory)
    (directory / ".metadata").write_bytes(pickle.dumps(_ThenGenuine(flag, genuine)))


def in_item(directory: Path, fqn: str, flag: Path) -> str:
    """The first non-tensor item of ``directory``'s ``.distcp`` files whose name starts with ``fqn`` replaced by
    the payload (appended to its file; ``.metadata`` points there); its name."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    metadata = _read_metadata(directory)
    index = next(index for index in metadata.storage_data if index.fqn.startswith(fqn)
                 and isinstance(metadata.state_dict_metadata[index.fqn], BytesStorageMetadata))
    info = metadata.storage_data[index]
    file = directory / info.relative_path
    with open(file, "rb") as stream:
        stream.seek(info.offset)
        genuine = torch.load(io.BytesIO(stream.read(info.length)), weights_only=False)
    payload = io.BytesIO()
    torch.save(_ThenGenuine(flag, genuine), payload)
    offset = file.stat().st_size
    with open(file, "ab") as stream:
        stream.write(payload.getvalue())
    metadata.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(payload.getvalue()))
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
    return index.fqn


def in_torch_file(file: Path, flag: Path) -> None:
    """A ``torch.save`` file (``common.pt``, a legacy ``model_optim_rng.pt``) replaced by the payload."""
    genuine = torch.load(file, weights_only=False)
    torch.save(_ThenGenuine(flag, genuine), file)

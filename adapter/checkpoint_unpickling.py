"""A checkpoint runs no code when it is loaded: every pickle in it is read through an allow-list (issue 51).

A checkpoint is a directory of pickles, and unpickling runs whatever callable a pickle names. torch's
``torch.load`` reads through its weights-only unpickler by default (torch 2.6+), with the globals megatron-core
registers for its state (``megatron.core.safe_globals``): a legacy ``model_optim_rng.pt``, a ``common.pt``, the
distributed optimizer's ``distrib_optim.pt`` and the tensors in torch DCP's ``.distcp`` files are read that way.
Two readers are not:

- torch DCP's ``FileSystemReader.read_metadata`` reads a checkpoint's ``.metadata`` with plain ``pickle.load``:
  here it reads through ``MetadataUnpickler``, which resolves only what DCP's metadata is made of (its own
  dataclasses and enums, torch's sizes, dtypes and layouts, paths), the restriction Python's pickle
  documentation gives ("Restricting Globals"); torch's weights-only unpickler reads only the pickle protocol
  ``torch.save`` writes, not the one ``pickle.dump`` does;
- DCP's ``DefaultLoadPlanner.load_bytes`` reads the non-tensor items of ``.distcp`` files (megatron's common
  state from 0.19, RNG states, the optimizer's step and groups, the arguments) with ``torch.load(...,
  weights_only=False)``: here with ``weights_only=True``, as the tensors beside them are read.

A pickle that names anything else is refused by ``UntrustedCheckpoint``, one line naming the file and the global
it asked for, before anything it names is imported or called. A checkpoint whose maker is trusted, and which
holds other objects, loads with Python's full pickle where its directory is named in ``ADAPTER_TRUSTED_CHECKPOINTS``
(README, Security). The registry entries are patches/checkpoint_unpickling.py.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import enum
import io
import os
import pickle
import re
from pathlib import Path

import torch

TRUSTED_ENV = "ADAPTER_TRUSTED_CHECKPOINTS"

# What DCP's metadata is made of, besides its own dataclasses and enums (torch.distributed.checkpoint.*) and
# torch's dtypes, layouts and memory formats: module -> names
_METADATA_GLOBALS = {"torch": {"Size"}, "torch.serialization": {"_get_layout"}, "collections": {"OrderedDict"},
                     "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
                     "builtins": {"set", "frozenset", "slice", "complex", "bytearray"}}
_DCP = "torch.distributed.checkpoint"
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)


class UntrustedCheckpoint(BaseException):
    """A pickle in a checkpoint asked for a global outside the allow-list; nothing it names was run.

    A BaseException, as torch DCP's own ``CheckpointException`` is, so that no ``except Exception`` on the way
    up takes it for a missing file: DCP's metadata read falls back to rank-local metadata on any Exception and
    then fails with only its text, and megatron.training ends on any Exception from a legacy load with
    ``sys.exit()``, status 0. Entry points say it in one line (``adapter.run.run_guarded``, ``as_refusal``)."""

    def __init__(self, file, global_name: str, item: str | None = None, directory=None):
        """``file`` asked for ``global_name`` (in its non-tensor ``item``); ``directory``, the one to name as
        trusted to load it anyway (the file's own by default)."""
        self.file, self.global_name, self.item, self.directory = str(file), global_name, item, directory
        where = f"{self.file} (item {item!r})" if item else self.file
        super().__init__(f"{where} asks to unpickle {global_name}, which no checkpoint of torch or megatron-core "
                         "holds: refused, and nothing in it was run (a checkpoint loads through an allow-list). If "
                         "you trust whoever made it, load it with Python's full pickle, which runs what it names: "
                         f"{TRUSTED_ENV}={directory or Path(self.file).parent}")

    def __reduce__(self):  # torch DCP sends a rank's failure to the others pickled
        return type(self), (self.file, self.global_name, self.item, self.directory)


def trusted(path) -> bool:
    """Whether ``path`` lies in a directory ``ADAPTER_TRUSTED_CHECKPOINTS`` names (os.pathsep-separated)."""
    named = [entry for entry in os.environ.get(TRUSTED_ENV, "").split(os.pathsep) if entry]
    if not named or path is None:
        return False
    resolved = Path(path).resolve()
    return any(resolved.is_relative_to(Path(entry).resolve()) for entry in named)


class MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` resolving only what torch DCP's ``Metadata`` holds; no other module is imported, and
    no attribute path (``Size.__class__...``) is followed."""

    def __init__(self, file, name: str):
        super().__init__(file)
        self._name = name

    def find_class(self, module: str, name: str):
        if "." not in name and (module in _METADATA_GLOBALS or module == _DCP or module.startswith(f"{_DCP}.")):
            try:
                found = super().find_class(module, name)
            except (ImportError, AttributeError):
                raise UntrustedCheckpoint(self._name, f"{module}.{name}") from None
            if (name in _METADATA_GLOBALS.get(module, ()) or (module == "torch" and isinstance(found, _TORCH_VALUES))
                    or (module.startswith(_DCP) and isinstance(found, type)
                        and (dataclasses.is_dataclass(found) or issubclass(found, enum.Enum)))):
                return found
        raise UntrustedCheckpoint(self._name, f"{module}.{name}")


class MetadataPickle:
    """Stands in for the ``pickle`` module in ``torch.distributed.checkpoint.filesystem``, whose one read is
    ``pickle.load(metadata_file)``; everything else is pickle's."""

    def load(self, file, **kwargs):
        name = getattr(file, "name", "a checkpoint's .metadata")
        if trusted(getattr(file, "name", None)):
            return pickle.load(file, **kwargs)
        return MetadataUnpickler(file, name).load()

    def __getattr__(self, name: str):
        return getattr(pickle, name)


# The .distcp file DCP's FileSystemReader is reading items from: (checkpoint directory, its storage index)
_reading: contextvars.ContextVar = contextvars.ContextVar("checkpoint_unpickling_reading", default=None)


@contextlib.contextmanager
def reading(directory, storage_data):
    """While DCP's reader reads ``directory``, its byte items can be named by their file."""
    token = _reading.set((directory, storage_data))
    try:
        yield
    finally:
        _reading.reset(token)


def _item_file(read_item) -> str:
    where = _reading.get()
    if where is None:
        return "a checkpoint's .distcp file"
    directory, storage_data = where
    info = storage_data.get(read_item.storage_index)
    return os.path.join(str(directory), info.relative_path) if info is not None else str(directory)


def load_item(value: io.BytesIO, read_item):
    """A non-tensor item of a ``.distcp`` file, read weights-only (full pickle in a trusted directory), with the
    classes megatron-core registers for its state (its RNG and rerun states, arguments, enums) allowed also
    where nothing imported megatron-core yet (a script converting a checkpoint with torch's DCP tools)."""
    import megatron.core  # noqa: F401 - registers them (megatron/core/safe_globals.py), once per process

    file, located = _item_file(read_item), _reading.get() is not None
    if trusted(file if located else None):
        return torch.load(value, weights_only=False)
    try:
        return torch.load(value, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UntrustedCheckpoint(file, _refused_global(exc), item=read_item.dest_index.fqn,
                                  directory=None if located else "<the checkpoint's directory>") from None


def _refused_global(exc: BaseException) -> str:
    """The global torch's weights-only unpickler refused, from its message."""
    found = re.search(r"GLOBAL (\S+)", str(exc)) or re.search(r"global:? ['`]?([\w.]+)", str(exc))
    return found[1] if found else "a global outside torch's weights-only allow-list"


def refused_torch_load(file, exc: BaseException) -> UntrustedCheckpoint | None:
    """``exc`` from ``torch.load`` of ``file`` as its ``UntrustedCheckpoint``, where the weights-only unpickler
    refused it; else None."""
    if isinstance(exc, pickle.UnpicklingError) and "weights_only" in str(exc).replace(" ", "_").lower():
        return UntrustedCheckpoint(file, _refused_global(exc))
    return None


def untrusted_in(exc: BaseException | None) -> UntrustedCheckpoint | None:
    """The ``UntrustedCheckpoint`` behind ``exc``: itself, its cause or context, or one rank's failure that torch
    DCP gathered into a ``CheckpointException``."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, UntrustedCheckpoint):
            return exc
        for failure in getattr(exc, "failures", {}).values():  # rank -> (exception, its traceback summary)
            found = untrusted_in(failure[0] if isinstance(failure, tuple) else failure)
            if found is not None:
                return found
        exc = exc.__cause__ or exc.__context__
    return None


_TORCH_FULL_PICKLE_ENV = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"


@contextlib.contextmanager
def full_pickle_if_trusted(path):
    """Within: ``torch.load`` without ``weights_only`` reads with Python's full pickle, where ``path`` lies in a
    trusted directory (torch's own switch, TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD); elsewhere nothing changes."""
    if not trusted(path) or os.environ.get(_TORCH_FULL_PICKLE_ENV):
        yield
        return
    os.environ[_TORCH_FULL_PICKLE_ENV] = "1"
    try:
        yield
    finally:
        os.environ.pop(_TORCH_FULL_PICKLE_ENV, None)


def first_untrusted_file(checkpoint, directory) -> UntrustedCheckpoint | None:
    """The first ``torch.save`` file under ``checkpoint`` (a legacy checkpoint's ``mp_rank_*/*.pt``) naming a
    global torch's weights-only unpickler refuses, as its refusal naming ``directory`` to trust; torch lists
    them without unpickling (``get_unsafe_globals_in_checkpoint``)."""
    for file in sorted(Path(checkpoint).rglob("*.pt")):
        try:
            unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(file)
        except (RuntimeError, OSError, ValueError):
            continue
        if unsafe:
            return UntrustedCheckpoint(file, unsafe[0], directory=directory)
    return None


@contextlib.contextmanager
def as_refusal():
    """Within: a refused pickle, however torch DCP gathered it (a ``CheckpointException``, a BaseException),
    is raised as its ``UntrustedCheckpoint``, for an entry point to say in one line."""
    try:
        yield
    except UntrustedCheckpoint:
        raise
    except BaseException as exc:
        untrusted = untrusted_in(exc)
        if untrusted is None:
            raise
        raise untrusted from None

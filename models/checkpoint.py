"""Model weights in megatron's torch_dist checkpoint format, as Megatron-LM lays it out on disk:

    <dir>/latest_checkpointed_iteration.txt   "release" or the iteration number
    <dir>/release/ or <dir>/iter_0000100/     metadata.json, .metadata, *.distcp (and common.pt, before 0.19)

torch_dist stores each tensor once, under its global shape, in chunks; megatron's loader reads whatever
region a rank needs, so one checkpoint loads at any TP/PP/VPP. This module writes such a checkpoint one
chunk at a time (memory: one tensor, not the model) and reads it back a layer at a time or into models.

The plain (non-tensor) "common" state moved in megatron-core 0.19: up to 0.18 ``dist_checkpointing.save``
writes it to ``common.pt``; from 0.19 it is the ShardedObject ``common_state`` inside the torch_dist files
and no ``common.pt`` is written. 0.19 still reads a ``common.pt`` (so checkpoints saved before the upgrade
resume), 0.16-0.18 cannot read the new form: such a checkpoint is refused up front (``readable_here``).
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
from pathlib import Path
from typing import Callable, Iterable

import torch
from torch.distributed.checkpoint import CheckpointException, FileSystemWriter
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint import save as dcp_save
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties)
from torch.distributed.checkpoint.planner import (LoadPlan, SavePlan, TensorWriteData, WriteItem,
                                                  WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from packaging.version import Version

from adapter.registry import installed_megatron_core_version

TRACKER = "latest_checkpointed_iteration.txt"
RELEASE = "release"
CHECKPOINT_VERSION = 3.0  # Megatron-LM's current checkpoint_version
COMMON_FILE = "common.pt"  # the common state up to megatron-core 0.18
MEGATRON_CORE = Version(installed_megatron_core_version())
# From 0.19 the common state is this ShardedObject inside the torch_dist files (its unique key "common_state/shard_0_1")
COMMON_STATE_IN_SHARDS = MEGATRON_CORE >= Version("0.19")


class CheckpointError(ValueError):
    """A checkpoint directory that is missing, incomplete or not what the caller expects."""


PARTIAL = ".partial"  # a checkpoint being written, beside its final name
REPLACED = ".replaced"  # the previous copy of an iteration saved again, until the new one is published


def aside(path: Path, suffix: str) -> Path:
    """``.<name><suffix>`` beside ``path``: hidden, so nothing that lists iterations takes it for one."""
    return path.with_name(f".{path.name}{suffix}")


def checkpoint_name(iteration: int | str) -> str:
    return RELEASE if str(iteration) == RELEASE else f"iter_{int(iteration):07d}"


def is_complete(path: Path) -> bool:
    """A torch_dist checkpoint whose save finished: torch writes ``.metadata`` once every rank's chunks are
    written, megatron writes ``metadata.json`` after that."""
    return (path / "metadata.json").is_file() and (path / ".metadata").is_file()


def newest_complete(load_dir: Path) -> Path | None:
    done = [p for p in load_dir.glob("iter_*") if p.name[5:].isdigit() and is_complete(p)]
    return max(done, key=lambda p: int(p.name[5:]), default=None)


def checkpoint_to_load(load_dir: str | os.PathLike, recoverable: bool = False) -> Path | None:
    """The checkpoint ``load_dir``'s tracker names (``load_dir`` itself if it is one); None when nothing was
    ever published there (no tracker, no complete iteration: training starts from scratch).

    A tracker naming a missing or incomplete checkpoint, or complete iterations without a tracker, is a
    CheckpointError naming it and the newest complete one: never a silent start from scratch, which would
    then overwrite the iterations there. ``recoverable``: ``load_dir`` is the run's own --save directory,
    where ``recover_interrupted_save`` first puts back the previous copy a killed re-save moved aside."""
    load_dir = Path(load_dir)
    if (load_dir / "metadata.json").is_file():
        readable_here(load_dir)
        return load_dir
    tracker = load_dir / TRACKER
    newest = newest_complete(load_dir) if load_dir.is_dir() else None
    if not tracker.is_file():
        if newest is None:
            return None
        raise CheckpointError(f"{load_dir} holds {newest.name} but no {TRACKER}: write {int(newest.name[5:])} into "
                              f"{tracker} to resume from it, or load from an empty directory to start afresh")
    text = tracker.read_text().strip()
    if text != RELEASE and not text.isdigit():
        raise CheckpointError(f"{tracker} holds {text!r}, not an iteration number or {RELEASE!r}")
    path = load_dir / checkpoint_name(text)
    if is_complete(path) or (recoverable and is_complete(aside(path, REPLACED))):
        readable_here(path if is_complete(path) else aside(path, REPLACED))
        return path
    state = "incomplete (no metadata.json and .metadata)" if path.exists() else "missing"
    previous = aside(path, REPLACED)
    fix = (f"; its previous copy is complete at {previous.name} (a save was killed while replacing it): "
           f"rename it to {path.name}" if is_complete(previous) else
           f"; the newest complete checkpoint there is {newest.name}: write {int(newest.name[5:])} into "
           f"{TRACKER} to resume from it" if newest else "; there is no complete checkpoint there")
    raise CheckpointError(f"{TRACKER} names {path}, which is {state}{fix}")


def iteration_dir(load_dir: str | os.PathLike, iteration: int | str | None = None) -> Path:
    """The checkpoint directory in ``load_dir``: ``iteration`` if given, else what the tracker file names;
    ``load_dir`` itself when it is a checkpoint directory (has metadata.json)."""
    load_dir = Path(load_dir)
    if iteration is None:
        path = checkpoint_to_load(load_dir)
        if path is None:
            raise CheckpointError(f"{load_dir} holds no megatron checkpoint: neither {TRACKER} nor "
                                  "metadata.json is there (pass the directory given to --save)")
        return path
    path = load_dir / checkpoint_name(iteration)
    if not is_complete(path):
        raise CheckpointError(f"{path} is not a complete torch_dist checkpoint (no metadata.json and .metadata)")
    readable_here(path)
    return path


def readable_here(checkpoint: Path) -> None:
    """Refuse a complete checkpoint the installed megatron-core cannot read, before any rank loads it.

    Every release reads a checkpoint with ``common.pt`` (0.19 as its legacy form). One without it was saved by
    0.19 or later, whose common state only 0.19 and later find: 0.16-0.18 would stop inside megatron's loader
    ("Common file ... does not exist") after every rank had built its model."""
    if COMMON_STATE_IN_SHARDS or (checkpoint / COMMON_FILE).is_file():
        return
    raise CheckpointError(f"{checkpoint} was saved by megatron-core 0.19 or later (its common state is inside the "
                          f"torch_dist files; there is no {COMMON_FILE}), which megatron-core {MEGATRON_CORE} "
                          "cannot read: load it with megatron-core 0.19 or later")


# ---------------------------------------------------------------------------------------------------------
# publishing: a checkpoint is never lost, whenever the process is killed

def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_tree(path: Path) -> None:
    """Put a written checkpoint on disk: every file but the ``.distcp`` chunks (their writers fsync those,
    on whichever node wrote them), then each directory's entries."""
    for folder, _, files in os.walk(path):
        for name in files:
            if not name.endswith(".distcp"):
                _fsync(Path(folder) / name)
        _fsync(Path(folder))


def write_tracker(save_dir: Path, iteration: int | str) -> None:
    """Point the tracker at ``iteration``: written beside it, on disk, then renamed over it."""
    tracker = aside(save_dir / TRACKER, PARTIAL)
    with open(tracker, "w") as out:
        out.write(str(iteration))
        out.flush()
        os.fsync(out.fileno())
    os.replace(tracker, save_dir / TRACKER)
    _fsync(save_dir)


def publish(partial: Path, iteration: int | str) -> Path:
    """Make the complete checkpoint written at ``partial`` the one its iteration's name and the tracker
    point to. Each step is on disk before the next, so a process killed at any instant leaves a complete
    checkpoint where the tracker points, or one ``recover_interrupted_save`` puts back: an existing copy
    of the iteration moves aside before the new one moves in, the tracker is replaced after, and the old
    copy is removed last."""
    save_dir = partial.parent
    final, previous = save_dir / checkpoint_name(iteration), aside(save_dir / checkpoint_name(iteration), REPLACED)
    sync_tree(partial)
    if final.exists():
        shutil.rmtree(previous, ignore_errors=True)  # left by an earlier kill, with ``final`` complete
        os.rename(final, previous)
        _fsync(save_dir)
    os.rename(partial, final)
    _fsync(save_dir)
    write_tracker(save_dir, iteration)
    if previous.exists():
        shutil.rmtree(previous)
    return final


def recover_interrupted_save(save_dir: str | os.PathLike) -> list[str]:
    """Finish or undo what a save killed while publishing left in ``save_dir``; returns what it did.

    A previous copy moved aside goes back if the new one never moved in, and is removed if it did (the
    new one is complete: it is renamed in only then); unpublished partial writes are removed. Only for a
    run's own --save directory, before it saves: another job may be publishing in a directory it loads."""
    save_dir, done = Path(save_dir), []
    for previous in sorted(save_dir.glob(f".*{REPLACED}")):
        final = save_dir / previous.name[1:-len(REPLACED)]
        if final.exists():
            shutil.rmtree(previous)
            done.append(f"removed {previous.name}, the replaced copy of the complete {final.name}")
        else:
            os.rename(previous, final)
            done.append(f"restored {final.name} from {previous.name} (a save was killed while replacing it)")
    for partial in sorted(save_dir.glob(f".*{PARTIAL}")):
        shutil.rmtree(partial) if partial.is_dir() else partial.unlink()
        done.append(f"removed {partial.name}, an unpublished write")
    if done:
        _fsync(save_dir)
    return done


@contextlib.contextmanager
def single_process_groups():
    """megatron's parallel state for a world of one, unless the caller already has one."""
    from megatron.core import parallel_state

    import adapter

    owned = not torch.distributed.is_initialized()
    if owned:
        adapter.init_distributed()
    owned_state = not parallel_state.model_parallel_is_initialized()
    if owned_state:
        parallel_state.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        if owned_state:
            parallel_state.destroy_model_parallel()
        if owned:
            torch.distributed.destroy_process_group()


def megatron_layout(model) -> list:
    """The ShardedTensors and ShardedObjects a whole megatron GPTModel of ``model`` (a ModelConfig)
    checkpoints, at TP 1 / PP 1, from a model built on the meta device (no memory, about 50 ms for 72B).
    Needs a model-parallel state of size 1 (``single_process_groups``)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import apply_factories

    from .provider import build_model, transformer_config

    with torch.device("meta"):
        gpt = build_model(model, transformer_config(
            model, perform_initialization=False, tensor_model_parallel_size=1,
            pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None),
            pre_process=True, post_process=True)
    sharded = gpt.sharded_state_dict()
    apply_factories(sharded)
    return list(nested_values(sharded))


# ---------------------------------------------------------------------------------------------------------
# writing

class _ChunkPlanner(DefaultSavePlanner):
    """A save plan made of the chunks given, each produced only when the writer reaches it."""

    def __init__(self, chunks: dict[str, tuple[WriteItem, Callable]]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._chunks = chunks
        self.failure: BaseException | None = None

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan(items=[item for item, _ in self._chunks.values()])
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        try:
            return self._chunks[_item_id(write_item.index)][1]()
        except BaseException as exc:  # torch wraps it in a CheckpointException; keep it to re-raise
            self.failure = exc
            raise


def _item_id(index: MetadataIndex) -> str:
    return f"{index.fqn}@{tuple(index.offset) if index.offset is not None else ''}"


def tensor_chunk(key: str, global_shape, offset, shape, dtype: torch.dtype,
                 produce: Callable[[], torch.Tensor]) -> tuple[WriteItem, Callable]:
    """A chunk of the checkpoint tensor ``key``: ``produce()`` returns it (shape ``shape``, at ``offset``
    of the global tensor), called once, when the writer gets to it."""
    item = WriteItem(index=MetadataIndex(key, torch.Size(offset)), type=WriteItemType.SHARD,
                     tensor_data=TensorWriteData(
                         chunk=ChunkStorageMetadata(offsets=torch.Size(offset), sizes=torch.Size(shape)),
                         properties=TensorProperties(dtype=dtype), size=torch.Size(global_shape)))

    def produce_checked():
        tensor = produce()
        if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
            raise CheckpointError(f"{key} at {tuple(offset)}: produced {tuple(tensor.shape)} "
                                  f"{tensor.dtype}, planned {tuple(shape)} {dtype}")
        return tensor.contiguous()

    return item, produce_checked


def object_chunk(unique_key: str, value) -> tuple[WriteItem, Callable]:
    """A ShardedObject as megatron stores one: the torch-serialised list of its values."""
    def produce():
        data = io.BytesIO()
        torch.save([value], data)
        data.seek(0)
        return data

    return WriteItem(index=MetadataIndex(unique_key), type=WriteItemType.BYTE_IO), produce


def common_chunks(common: dict) -> list[tuple[WriteItem, Callable]]:
    """The ``common`` state as a chunk of the torch_dist files where the installed megatron-core's save puts
    it (0.19 and later: the ShardedObject ``common_state``); none before 0.19, where it is ``common.pt``."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    if not COMMON_STATE_IN_SHARDS:
        return []
    return [object_chunk(ShardedObject("common_state", None, (1,), (0,)).unique_key, common)]


def write_checkpoint(save_dir: str | os.PathLike, chunks: Iterable[tuple[WriteItem, Callable]],
                     common: dict, iteration: int | str = RELEASE) -> Path:
    """Write a torch_dist checkpoint from ``chunks`` and the plain ``common`` state, then point the
    tracker file at it. Atomic: it is written beside its final name and renamed when complete, and the
    tracker is replaced last, so an interrupted write leaves any earlier checkpoint as it was.

    Laid out as the installed megatron-core's ``dist_checkpointing.save`` lays out its own: the common state
    in ``common.pt`` up to 0.18, inside the torch_dist files from 0.19 (``common_chunks``); metadata.json
    names the sharded backend (0.16-0.18 add their one common backend, torch v1, as a default)."""
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy

    save_dir = Path(save_dir)
    final = save_dir / checkpoint_name(iteration)
    if final.exists():
        raise CheckpointError(f"{final} exists already: choose another --save-dir or remove it")
    partial = aside(final, PARTIAL)
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        by_id = {_item_id(item.index): (item, produce) for item, produce in [*chunks, *common_chunks(common)]}
        # one file per chunk: the writer keeps every tensor of a file alive until the file is closed
        writer = FileSystemWriter(partial, single_file_per_rank=False)
        planner = _ChunkPlanner(by_id)
        try:
            dcp_save({}, storage_writer=writer, planner=planner, no_dist=True)
        except CheckpointException:
            if planner.failure is not None:  # the producer's own error, not torch's wrapper
                raise planner.failure from None
            raise
        if not COMMON_STATE_IN_SHARDS:
            torch.save(common, partial / COMMON_FILE)
        sharded = get_default_save_sharded_strategy()
        save_config(CheckpointingConfig(sharded.backend, sharded.version), partial)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return publish(partial, iteration)


# ---------------------------------------------------------------------------------------------------------
# reading

def read_common(checkpoint: Path) -> dict:
    """The plain state of ``checkpoint``, through megatron's own reader: it finds ``common.pt`` on every
    release, and from 0.19 also the ``common_state`` object that replaced it."""
    from megatron.core import dist_checkpointing

    readable_here(checkpoint)
    return dist_checkpointing.load_common_state_dict(str(checkpoint))


def tensors_metadata(checkpoint: Path) -> dict:
    """{key: ShardedTensor without data} for every tensor in ``checkpoint`` (global shape and dtype)."""
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load_tensors_metadata(str(checkpoint))


class _RegionPlanner(DefaultLoadPlanner):
    """Reads given regions of checkpoint tensors into given tensors, whatever chunks they were saved in."""

    def __init__(self, regions: dict[str, tuple[tuple, torch.Tensor]]):
        # key -> (offset of the region in the global tensor, the tensor to read it into)
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._regions = regions

    def create_local_plan(self) -> LoadPlan:
        items = []
        for key, (offset, target) in self._regions.items():
            items += create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], [
                ChunkStorageMetadata(offsets=torch.Size(offset), sizes=target.shape)])
        return LoadPlan(items)

    def resolve_tensor(self, read_item):
        target = self._regions[read_item.dest_index.fqn][1]
        return target[tuple(slice(o, o + n) for o, n in zip(read_item.dest_offsets, read_item.lengths))]

    def commit_tensor(self, read_item, tensor) -> None:
        pass  # the reader copied into the view resolve_tensor gave


def checkpoint_reader(checkpoint: Path):
    """A reader of ``checkpoint`` that parses its metadata once, for many ``read_regions`` calls."""
    from megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader import (
        CachedMetadataFileSystemReader)

    return CachedMetadataFileSystemReader(checkpoint)


def read_regions(reader, regions: dict[str, tuple[tuple, tuple, torch.dtype]]) -> dict[str, torch.Tensor]:
    """Read ``regions[key] = (offset, shape, dtype)`` of checkpoint tensors: the checkpoint's chunks that
    overlap each region are read and narrowed, whatever layout saved them."""
    targets = {key: (offset, torch.empty(shape, dtype=dtype)) for key, (offset, shape, dtype) in regions.items()}
    dcp_load({}, storage_reader=reader, planner=_RegionPlanner(targets), no_dist=True)
    return {key: target for key, (_, target) in targets.items()}


def load_model_weights(chunks: list, load_dir: str | os.PathLike, iteration=None) -> Path:
    """Load the weights of ``chunks`` (this rank's megatron model chunks, any TP/PP/VPP) from a
    torch_dist checkpoint; every rank calls it. Returns the checkpoint directory read."""
    from megatron.core import dist_checkpointing

    checkpoint = iteration_dir(load_dir, iteration)
    sharded = {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}
    loaded = dist_checkpointing.load(sharded, str(checkpoint))
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(loaded[f"model{i}"])
    return checkpoint

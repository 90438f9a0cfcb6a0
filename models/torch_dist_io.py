"""Model weights in megatron's torch_dist format, a chunk at a time: the writer and reader under
conversion and ``models.verify``. Where a checkpoint lives and how it is published is ``checkpoint_dir``'s.

torch_dist stores each tensor once, under its global shape, in chunks; megatron's loader reads whatever
region a rank needs, so one checkpoint loads at any TP/PP/VPP. This module writes such a checkpoint one
chunk at a time (memory: one tensor, not the model) and reads it back a region at a time or into models.
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

from adapter import checkpoint_dir
from adapter.checkpoint_dir import COMMON_FILE, COMMON_STATE_IN_SHARDS, PARTIAL, RELEASE, CheckpointError

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
    final = save_dir / checkpoint_dir.checkpoint_name(iteration)
    if final.exists():
        raise CheckpointError(f"{final} exists already: choose another --save-dir or remove it")
    partial = checkpoint_dir.aside(final, PARTIAL)
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
    return checkpoint_dir.publish(partial, iteration)


# ---------------------------------------------------------------------------------------------------------
# reading


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

    checkpoint = checkpoint_dir.iteration_dir(load_dir, iteration)
    sharded = {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}
    loaded = dist_checkpointing.load(sharded, str(checkpoint))
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(loaded[f"model{i}"])
    return checkpoint

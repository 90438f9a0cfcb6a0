"""Every pickle of a checkpoint read through an allow-list: torch DCP's ``.metadata`` and ``.distcp`` byte items,
megatron-core's ``common.pt``, megatron.training's legacy format (adapter/checkpoint_unpickling.py).

The torch DCP entries stand in for torch 2.13's code (``filesystem.FileSystemReader.read_metadata``'s one
``pickle.load``, ``DefaultLoadPlanner.load_bytes``'s two stores); the registry's version guard is megatron-core's,
so a torch that changes them is caught by tests/test_checkpoint_unpickling.py, not by the guard."""

from __future__ import annotations

import functools
import os
import pickle
from pathlib import Path

from adapter import checkpoint_dir, checkpoint_unpickling

_DCP = "torch.distributed.checkpoint"
_COMMON = "megatron.core.dist_checkpointing.strategies.common"


def load_bytes(planner, read_item, value) -> None:
    """``DefaultLoadPlanner.load_bytes``, the item read weights-only as the tensors beside it are."""
    from torch.distributed.checkpoint._traverse import set_element

    loaded = checkpoint_unpickling.load_item(value, read_item)
    if planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[read_item.dest_index.fqn], loaded)
    else:
        planner.state_dict[read_item.dest_index.fqn] = loaded


def naming_files(read_data):
    """``FileSystemReader.read_data``; while it reads, a refused byte item can name its ``.distcp`` file."""

    @functools.wraps(read_data)
    def read(reader, *args, **kwargs):
        with checkpoint_unpickling.reading(reader.path, reader.storage_data):
            return read_data(reader, *args, **kwargs)

    return read


def common_state_refused(load_common):
    """megatron-core's reader of ``common.pt`` (``torch.load``, weights-only by default): a refused global is
    one line naming the file; in a trusted directory, full pickle."""

    @functools.wraps(load_common)
    def load(*args, **kwargs):
        file = os.path.join(str(kwargs.get("checkpoint_dir", args[-1] if args else "")), "common.pt")
        try:
            with checkpoint_unpickling.full_pickle_if_trusted(file):
                return load_common(*args, **kwargs)
        except pickle.UnpicklingError as exc:
            refused = checkpoint_unpickling.refused_torch_load(file, exc)
            if refused is None:
                raise
            raise refused from None

    return load


def legacy_refused(load_base_checkpoint):
    """megatron.training's ``_load_base_checkpoint``. A legacy (``--ckpt-format torch``) file that torch's
    weights-only ``torch.load`` refuses is caught there, printed over several lines and ended with
    ``sys.exit()``, status 0: the files of the iteration it loads are looked at first (torch lists a file's
    globals without unpickling it), and a refused one is the one line naming the file and the global. In a
    trusted directory, full pickle."""

    @functools.wraps(load_base_checkpoint)
    def load(load_dir, args, *rest, **kwargs):
        legacy = _legacy_iteration(load_dir, args) if load_dir else None
        if legacy is not None and not checkpoint_unpickling.trusted(load_dir):
            refused = checkpoint_unpickling.first_untrusted_file(legacy, directory=load_dir)
            if refused is not None:
                raise refused
        with checkpoint_unpickling.full_pickle_if_trusted(load_dir):
            return load_base_checkpoint(load_dir, args, *rest, **kwargs)

    return load


def _legacy_iteration(load_dir, args) -> Path | None:
    """The legacy checkpoint directory megatron will read in ``load_dir`` (``--ckpt-step``, else the tracker's),
    where it holds ``mp_rank_*`` files; None otherwise (megatron says what is wrong with a tracker)."""
    tracker = Path(load_dir) / checkpoint_dir.TRACKER
    try:
        step = getattr(args, "ckpt_step", None) or (tracker.read_text().strip() if tracker.is_file() else None)
        path = Path(load_dir) / checkpoint_dir.checkpoint_name(step) if step is not None else None
    except ValueError:
        return None
    return path if path is not None and any(path.glob("mp_rank_*")) else None


def register(registry, versions: str) -> None:
    registry.replace(f"{_DCP}.filesystem:pickle", checkpoint_unpickling.MetadataPickle(), versions=versions,
                     rebind_copies=False,
                     reason="torch DCP reads a checkpoint's .metadata with plain pickle.load: through an allow-list")
    registry.replace(f"{_DCP}.default_planner:DefaultLoadPlanner.load_bytes", load_bytes, versions=versions,
                     reason="torch DCP reads a checkpoint's non-tensor items with weights_only=False: weights-only")
    registry.wrap(f"{_DCP}.filesystem:FileSystemReader.read_data", naming_files, versions=versions,
                  reason="a refused non-tensor item of a checkpoint names its .distcp file")
    # megatron-core 0.17.0 made the common strategy's load_common a function of the module
    registry.wrap(f"{_COMMON}:load_common", common_state_refused, versions=">=0.17,<=0.19.2", optional=True,
                  reason="a common.pt that torch.load refuses fails with its long message: one line naming the global")
    registry.wrap(f"{_COMMON}:TorchCommonLoadStrategy.load_common", common_state_refused, versions=">=0.16.1,<0.17",
                  optional=True,
                  reason="a common.pt that torch.load refuses fails with its long message: one line naming the global")
    registry.wrap("megatron.training.checkpointing:_load_base_checkpoint", legacy_refused, versions=versions,
                  optional=True, reason="a legacy checkpoint torch.load refuses ends megatron with status 0: one line")

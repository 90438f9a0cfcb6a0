"""megatron.training's checkpoint saves published atomically, a killed save recovered at the next start, a
failed save stopping every rank (``adapter/checkpoint_publish.py``). The megatron-core wheel has
megatron.training from 0.17; on 0.16.1 these targets stay pending until a Megatron-LM checkout is imported."""

from __future__ import annotations

from packaging.version import Version

from adapter import checkpoint_publish
from adapter.registry import installed_megatron_core_version

_C = "megatron.training.checkpointing:"


def register(registry, versions: str) -> None:
    registry.wrap(f"{_C}save_checkpoint", checkpoint_publish.published_save, versions=versions,
                  reason="writes iter_N in place, then the tracker; a failure on one rank leaves the rest in a barrier")
    registry.wrap(f"{_C}get_checkpoint_name", checkpoint_publish.partial_checkpoint_name, versions=versions,
                  reason="a save's files go into .iter_N.partial, published once complete")
    registry.wrap(f"{_C}load_checkpoint", checkpoint_publish.recovered_before_load, versions=versions,
                  reason="a save killed while publishing is put back before the tracker is read")
    registry.wrap("megatron.training.async_utils:maybe_finalize_async_save", checkpoint_publish.shared_async_finalize,
                  versions=versions, reason="publishes --async-save checkpoints; a failure on one rank hangs the rest")
    # the tracker write: rank 0 publishes the save there (only this module's opener; megatron.core's stays)
    if Version(installed_megatron_core_version()) >= Version("0.19"):
        registry.replace(f"{_C}maybe_msc", checkpoint_publish.TrackerPublishingStorage(), versions=versions,
                         rebind_copies=False, reason="rewrites the tracker in place with a plain open('w')")
    else:
        registry.replace(f"{_C}open_file", checkpoint_publish.tracker_open_file, versions=versions,
                         rebind_copies=False, reason="rewrites the tracker in place with a plain open('w')")

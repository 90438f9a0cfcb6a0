"""Synchronous checkpoint saves collect their write results in process (``adapter.checkpoint_writes``)."""

from adapter.checkpoint_writes import in_process_unless_async, in_process_when_synchronous

_WRITER = "megatron.core.dist_checkpointing.strategies.filesystem_async"
# megatron-core 0.16 names it _get_write_results_queue; 0.17+ get_write_results_queue(mp_mode)
_QUEUES = ((f"{_WRITER}:_get_write_results_queue", "0.16"), (f"{_WRITER}:get_write_results_queue", "0.17+"))


def register(registry, versions: str) -> None:
    for target, where in _QUEUES:
        registry.wrap(target, in_process_when_synchronous, versions=versions, optional=True,
                      reason="a synchronous save's write results need no Manager spawned at the first save "
                             f"(a fresh interpreter re-importing the entry script, ~8 s of CPU per rank; {where})")
    registry.wrap("megatron.training.checkpointing:save_checkpoint", in_process_unless_async, versions=versions,
                  reason="a save without --async-save spawns the writer's Manager at its first save all the same "
                         "(~8 s of CPU per rank); its results need none")

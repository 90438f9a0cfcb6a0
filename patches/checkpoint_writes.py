"""Synchronous checkpoint saves collect their write results in process, asynchronous ones copy their host
tensors before training goes on, and the persistent checkpoint worker imports the adapter first
(``adapter.checkpoint_writes``)."""

from adapter.checkpoint_writes import (host_tensors_copied_unless_synchronous, in_process_unless_async,
                                       in_process_when_synchronous, loop_after_the_adapter)

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
    registry.wrap(f"{_WRITER}:FileSystemWriterAsync.preload_tensors", host_tensors_copied_unless_synchronous,
                  versions=versions, optional=True,
                  reason="an asynchronous save stages tensors with .to('cpu'), which copies nothing for a host "
                         "tensor: the writer read parameters that training went on updating")
    registry.wrap("megatron.core.dist_checkpointing.strategies.async_utils:PersistentAsyncCaller.async_loop",
                  loop_after_the_adapter, versions=versions, optional=True,
                  reason="the persistent checkpoint worker (--use-persistent-ckpt-worker), a spawned process, runs "
                         "megatron's torch.cuda calls unrouted unless the parent's main module imported the adapter")

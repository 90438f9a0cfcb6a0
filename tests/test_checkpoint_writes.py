"""The flow's synchronous saves collect megatron's write results in process (adapter.checkpoint_writes):
no multiprocessing Manager is spawned at the first save, and what was saved loads back; a save outside
the flow's scope still gets megatron's own Manager queue (which Megatron-LM's asynchronous saves need)."""

import multiprocessing.process
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.strategies import filesystem_async

from adapter import checkpoint_writes
from tests.kernel_reference import one_rank_model_parallel


@pytest.fixture
def started(monkeypatch):
    """The names of the processes started from here on (a Manager's server is 'SyncManager-N'); megatron's
    cached results queue, if any, put back afterwards."""
    names, start = [], multiprocessing.process.BaseProcess.start

    def recording_start(process):
        names.append(process.name)
        return start(process)

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", recording_start)
    monkeypatch.setattr(filesystem_async, "_results_queue", None)
    return names


def _save_and_load(directory):
    weight = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    state = {"weight": ShardedTensor.from_rank_offsets("weight", weight)}
    dist_checkpointing.save(state, str(directory))
    empty = {"weight": ShardedTensor.from_rank_offsets("weight", torch.zeros(3, 4))}
    return weight, dist_checkpointing.load(empty, str(directory))["weight"]


def test_a_synchronous_save_in_the_flows_scope_spawns_no_manager_and_loads_back(tmp_path, started):
    with one_rank_model_parallel(), checkpoint_writes.results_in_process():
        saved, loaded = _save_and_load(tmp_path)
    assert torch.equal(loaded, saved)
    assert not [name for name in started if name.startswith("SyncManager")], started


def test_a_save_outside_the_scope_keeps_megatrons_manager_queue(tmp_path, started):
    with one_rank_model_parallel():
        saved, loaded = _save_and_load(tmp_path)
    assert torch.equal(loaded, saved)
    assert [name for name in started if name.startswith("SyncManager")], started


def test_megatron_training_s_save_is_in_the_scope_unless_async_save(monkeypatch):
    """megatron.training's ``save_checkpoint`` as registered: in the in-process scope without --async-save
    (so its first save spawns no Manager), outside it with --async-save (its writer process needs one)."""
    global_vars = pytest.importorskip("megatron.training.global_vars")
    import megatron.training.checkpointing as checkpointing

    assert "in_process_unless_async.<locals>.save" in _layers(checkpointing.save_checkpoint)
    in_scope = []

    def save():
        in_scope.append(getattr(checkpoint_writes._SCOPE, "queue", None) is not None)

    for async_save in (False, True):
        monkeypatch.setattr(global_vars, "get_args", lambda: SimpleNamespace(async_save=async_save))
        checkpoint_writes.in_process_unless_async(save)()
    assert in_scope == [True, False]


def _layers(function) -> list[str]:
    """The qualified names of ``function``'s layers of wrapping, outermost first."""
    names = []
    while function is not None:
        names.append(function.__code__.co_qualname)
        function = getattr(function, "__wrapped__", None)
    return names


def _buckets(tensor):
    """One of megatron's write buckets (file name, storage key, (byte items, tensor items)) holding ``tensor``."""
    return [("f.distcp", "f.distcp", ([], [("item", tensor)]))]


def test_an_asynchronous_save_stages_host_tensors_as_copies_and_a_synchronous_one_as_they_are():
    """megatron stages an asynchronous save with tensor.to("cpu") and lets training go on, trusting it to copy
    (a device-to-host transfer): a host tensor came back as itself, and the writer saw the next steps' values."""
    weight = torch.arange(6, dtype=torch.float32)
    (_, _, (_, [(_, staged)])), = filesystem_async.FileSystemWriterAsync.preload_tensors(_buckets(weight), False)
    weight.add_(100)
    assert staged.untyped_storage().data_ptr() != weight.untyped_storage().data_ptr()
    assert torch.equal(staged, torch.arange(6, dtype=torch.float32))
    with checkpoint_writes.results_in_process():
        (_, _, (_, [(_, as_is)])), = filesystem_async.FileSystemWriterAsync.preload_tensors(_buckets(weight), False)
    assert as_is is weight


def test_the_persistent_workers_loop_brings_the_adapter_into_a_fresh_interpreter():
    """megatron starts its persistent checkpoint worker with 'spawn' or 'forkserver': a fresh interpreter
    unpickling the loop. Unpickled there, it imports the adapter (whose routing the loop's torch.cuda calls
    need) before megatron's module, and is that interpreter's own loop."""
    import pickle
    import subprocess
    import sys

    from megatron.core.dist_checkpointing.strategies.async_utils import PersistentAsyncCaller

    payload = pickle.dumps(PersistentAsyncCaller.async_loop)
    check = ("import pickle, sys; loop = pickle.loads(bytes.fromhex(sys.argv[1])); "
             "from megatron.core.dist_checkpointing.strategies.async_utils import PersistentAsyncCaller as P; "
             "print('adapter' in sys.modules, loop is P.async_loop, loop.__wrapped__ is not loop)")
    done = subprocess.run([sys.executable, "-c", check, payload.hex()], capture_output=True, text=True,
                          cwd=str(Path(__file__).resolve().parent.parent), timeout=300)
    assert done.stdout.split() == ["True", "True", "True"], done.stdout + done.stderr[-3000:]

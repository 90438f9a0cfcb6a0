"""Process groups of one rank that answer their collectives on the calling thread, for gloo's groups.

On one rank every collective is the identity or a copy: an all-reduce, broadcast or barrier changes nothing,
and an all-gather, gather, scatter, reduce-scatter or all-to-all copies the input into the output. megatron
builds its whole layout of groups at any size, so a run at tensor-parallel size 1 still makes three one-rank
all-reduces a step in the vocab-parallel cross entropy, and one rank alone makes one in every group it uses.
``ProcessGroupGloo`` hands each to its worker thread and waits for it: 50 us and more per call at any size
(4 us here), and the copies it makes there start OpenMP teams of their own, after which libgomp throttles
the training thread's parallel regions (docs/PERFORMANCE.md, "The distributed optimizer on a small
model"). NCCL and HCCL groups keep their library: their collectives are stream-ordered device work, and a
one-rank communicator there costs a launch, not a thread hand-over.

Only a group megatron asks gloo for (explicitly, or by default or by routing on the cpu backend) is made one:
the device backends' groups stay theirs, and so does the default group, which torch.distributed.checkpoint
and the launchers' barriers use. ``ADAPTER_ONE_RANK_GROUPS`` changes that for measuring: ``all`` makes the
device backends' one-rank groups these too (on one GPU, megatron's tensor-, data- and expert-parallel NCCL
groups: their collectives are then no device work, or a copy on the current stream, and no NCCL host call),
``none`` leaves every group to its library (the reference the benchmarks and tests compare with).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup

from adapter.torch_view import route_backend

NAME = "adapter_one_rank"
SETTING = "ADAPTER_ONE_RANK_GROUPS"
# each setting's libraries (as routed for this backend) whose one-rank groups are made these
LIBRARIES = {"gloo": ("gloo",), "all": ("gloo", "nccl", "hccl"), "none": ()}


class _Done(dist._Work):
    """A collective finished when it was called: waiting returns at once, its future holds ``result``."""

    def __init__(self, result=None):
        super().__init__()
        self._result = result if result is not None else []
        self._future = torch.futures.Future()
        self._future.set_result(self._result)

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def result(self):
        return self._result

    def get_future(self):
        return self._future


def _copy(output: torch.Tensor, source: torch.Tensor) -> None:
    """``output`` given ``source``'s values (one rank's part is the whole), unless it is that memory already
    (megatron's in-place bucket collectives); a size that does not fit is refused, as gloo refuses it."""
    if output.numel() != source.numel():
        raise ValueError(f"a one-rank collective's output holds {output.numel()} elements and its input "
                         f"{source.numel()}: on one rank they are the same tensor, sized alike")
    if not (output.data_ptr() == source.data_ptr() and output.is_contiguous() and source.is_contiguous()):
        output.copy_(source.reshape(output.shape))


def _unchanged(op) -> None:
    """A reduction over one rank is its input, but for a pre-multiplied sum, which gloo refuses too."""
    if op == dist.ReduceOp.PREMUL_SUM:
        raise RuntimeError("Cannot use ReduceOp.PREMUL_SUM with Gloo, nor with its one-rank groups: it is NCCL's. "
                           "Scale the tensor first and use ReduceOp.SUM.")


def _copied(outputs, sources) -> _Done:
    for output, source in zip(outputs, sources):
        _copy(output, source)
    return _Done(outputs)


class OneRankGroup(ProcessGroup):
    """A gloo group's stand-in where the group is one rank: each collective runs here, now, as gloo's
    would have come out (the tests compare them call by call)."""

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return NAME

    # A ProcessGroup keeps its name and description in its device backends, and this one has none: torch
    # sets and reads them through these, from Python.
    def _set_group_name(self, name: str) -> None:
        self._name = name

    @property
    def group_name(self) -> str:
        return self._name

    def _set_group_desc(self, desc: str) -> None:
        self._desc = desc

    @property
    def group_desc(self) -> str:
        return self._desc

    def allreduce(self, tensors, opts):
        _unchanged(opts.reduceOp)
        return _Done(tensors)

    def allreduce_coalesced(self, tensors, opts):
        return self.allreduce(tensors, opts)

    def reduce(self, tensors, opts):
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors, opts):
        return _Done(tensors)

    def barrier(self, opts=None):
        return _Done()

    def monitored_barrier(self, timeout=None, wait_all_ranks=False) -> None:
        return None

    def allgather(self, output_lists, inputs, opts=None):
        _copied([outputs[0] for outputs in output_lists], inputs)
        return _Done(output_lists)

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        return self.allgather(output_lists, inputs, opts)

    def all_gather_single(self, output, source, opts=None):  # all_gather_into_tensor
        _copy(output, source)
        return _Done([output])

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        return _copied(outputs, inputs)

    def gather(self, output_lists, inputs, opts=None):
        if output_lists:  # the root's list; gather_object passes its own
            _copy(output_lists[0][0], inputs[0])
        return _Done(output_lists)

    def scatter(self, outputs, input_lists, opts=None):
        if input_lists:
            _copy(outputs[0], input_lists[0][0])
        return _Done(outputs)

    def reduce_scatter(self, outputs, input_lists, opts):
        _unchanged(opts.reduceOp)
        return _copied(outputs, [sources[0] for sources in input_lists])

    def reduce_scatter_single(self, output, source, opts):  # reduce_scatter_tensor
        _unchanged(opts.reduceOp)
        _copy(output, source)
        return _Done([output])

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts):
        _unchanged(opts.reduceOp)
        return _copied(outputs, inputs)

    def all_to_all_single(self, output, source, output_split_sizes, input_split_sizes, opts=None):
        _copy(output, source)
        return _Done([output])

    def alltoall(self, outputs, inputs, opts=None):
        return _copied(outputs, inputs)

    # the names earlier torch releases call these by (torch_npu pins its torch, often an older one)
    _allgather_base, allgather_into_tensor_coalesced = all_gather_single, all_gather_single_coalesced
    _reduce_scatter_base, reduce_scatter_tensor_coalesced = reduce_scatter_single, reduce_scatter_single_coalesced
    alltoall_base = all_to_all_single

    def send(self, tensors, dst, tag):
        raise RuntimeError(f"send to rank {dst} in a group of one rank: there is no other rank")

    def recv(self, tensors, src, tag):
        raise RuntimeError(f"recv from rank {src} in a group of one rank: there is no other rank")

    def recv_anysource(self, tensors, tag):
        raise RuntimeError("recv from any rank in a group of one rank: there is no other rank")


def _create(store, rank: int, size: int, timeout) -> OneRankGroup:
    return OneRankGroup(rank, size)


@functools.cache
def registered() -> str:
    """The backend's name, registered with torch.distributed on first use (once per process)."""
    if NAME.upper() not in vars(dist.Backend):
        dist.Backend.register_backend(NAME, _create, devices=["cpu"])
    return NAME


def libraries() -> tuple[str, ...]:
    """The libraries whose one-rank groups are made these: ``$ADAPTER_ONE_RANK_GROUPS`` (default gloo)."""
    setting = os.environ.get(SETTING, "gloo").strip().lower() or "gloo"
    if setting not in LIBRARIES:
        raise ValueError(f"{SETTING}={setting!r}: use gloo (the default: gloo's one-rank groups), all (NCCL's "
                         "and HCCL's too) or none (every group left to its library)")
    return LIBRARIES[setting]


def answers_here(ranks, backend) -> bool:
    """Whether a group of ``ranks`` asked for with ``backend`` (None: the default group's) is made one of
    these: one rank, of a library ``libraries()`` names as routed for this backend."""
    if ranks is None or len(ranks) != 1:
        return False
    return route_backend(backend if backend is not None else dist.get_backend()) in libraries()


def one_rank_groups_answered_here(create_group):
    """megatron's ``parallel_state.create_group``, making a one-rank gloo group a ``OneRankGroup``. Every
    rank decides alike (from ``ranks`` and ``backend``, which every rank passes alike), as new_group needs;
    the options of a gloo group of one rank have nothing left to set."""

    @functools.wraps(create_group)
    def creating(ranks=None, timeout=None, backend=None, pg_options=None, *args, **kwargs):
        if answers_here(ranks, backend):
            backend, pg_options = registered(), None
        return create_group(ranks, timeout, backend, pg_options, *args, **kwargs)

    return creating

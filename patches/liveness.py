"""Hang and stall detection that names the group (adapter/liveness.py) for megatron.training: Megatron-LM's own
pretrain_gpt.py through ``adapter.run``, or any script calling megatron.training's ``pretrain``.

megatron.training has only the process groups' own timeouts (on gloo an asynchronous all-reduce's ``wait()``
outlives them; NCCL's watchdog names no megatron group) and its straggler detector, which measures and does
not end anything. So the adapter's watch starts where megatron.training has made its groups, with its
``--distributed-timeout-minutes``: a stalled peer ends every other rank within that time, with one line
naming the collective, its megatron group, its ranks and who never arrived; once megatron sets the groups'
timeouts to ``--distributed-timeout-seconds-after-init`` (after the first iteration), the watch judges by
that one. The watch stops at the
interpreter's exit, before the groups' destructors (megatron.training never destroys its groups).

Stragglers: megatron's own detector (``--log-straggler``) times with CUDA events and prints the minimum and
maximum ranks' throughput when asked; it names no rank that keeps the others waiting on gloo or HCCL. So after
each ``training_log`` of a log interval the adapter's check (``liveness.StragglerCheck``) gathers each rank's
time outside collectives and names a rank that stays above the others.
"""

from __future__ import annotations

import functools

import torch

from adapter import liveness


def watched(initialize_distributed):
    """``_initialize_distributed``, then the watch over every collective from here on (megatron's model-parallel
    groups stand by then, so the line names them). Not over ``--fake-process-group``, whose collectives never
    wait."""

    @functools.wraps(initialize_distributed)
    def initialize(*args, **kwargs):
        from megatron.training.global_vars import get_args

        result = initialize_distributed(*args, **kwargs)
        megatron_args = get_args()
        if torch.distributed.is_initialized() and not getattr(megatron_args, "fake_process_group", False):
            liveness.watch(megatron_args.distributed_timeout_minutes)
        return result

    return initialize


def retimed(update_pg_timeout):
    """``update_pg_timeout``, then the watch on the same timeout where every group got it (megatron's
    ``--distributed-timeout-seconds-after-init``; gloo's own timeout would otherwise end a stalled wait first,
    with a traceback)."""

    @functools.wraps(update_pg_timeout)
    def update(timeout, pg=None):
        result = update_pg_timeout(timeout, pg)
        if pg is None and liveness.watching():
            liveness.retime(timeout.total_seconds(), "--distributed-timeout-seconds-after-init")
        return result

    return update


def straggler_checked(training_log):
    """``training_log``, then the straggler check at megatron's log interval (one gather every interval)."""
    check: list = []

    @functools.wraps(training_log)
    def log(*args, **kwargs):
        from megatron.training.global_vars import get_args

        result = training_log(*args, **kwargs)
        if torch.distributed.is_initialized() and liveness.watching():
            if not check:
                check.append(liveness.StragglerCheck(get_args().log_interval))
            check[0].step(kwargs["iteration"] if "iteration" in kwargs else args[3])
        return result

    return log


def register(registry, versions: str) -> None:
    registry.wrap("megatron.training.initialize:_initialize_distributed", watched, versions=versions,
                  reason="a stalled peer ends every rank within --distributed-timeout-minutes, naming the group")
    registry.wrap("megatron.training.training:training_log", straggler_checked, versions=versions,
                  reason="a rank that keeps the others waiting is named, in one line (adapter.liveness)")
    registry.wrap("megatron.core.parallel_state:update_pg_timeout", retimed, versions=versions,
                  reason="the hang watch follows --distributed-timeout-seconds-after-init (adapter.liveness)")

"""Hang and stall detection that names the group (adapter/liveness.py) for megatron.training: Megatron-LM's own
pretrain_gpt.py through ``adapter.run``, or any script calling megatron.training's ``pretrain``.

megatron.training has only the process groups' own timeouts (on gloo an asynchronous all-reduce's ``wait()``
outlives them; NCCL's watchdog names no megatron group) and its straggler detector, which measures and does
not end anything. So the adapter's watch starts where megatron.training has made its groups, with its
``--distributed-timeout-minutes``: a stalled peer ends every other rank within that time, with one line
naming the collective, its megatron group, its ranks and who never arrived. The watch stops at the
interpreter's exit, before the groups' destructors (megatron.training never destroys its groups).
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


def register(registry, versions: str) -> None:
    registry.wrap("megatron.training.initialize:_initialize_distributed", watched, versions=versions,
                  reason="a stalled peer ends every rank within --distributed-timeout-minutes, naming the group")

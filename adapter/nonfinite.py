"""What a non-finite step is, in words: megatron-core's rerun state machine rejects a loss or a
gradient bucket's norm (``--check-for-nan-in-loss-and-grad``, on by default), and the run stops with one line
naming the iteration, the first rank that found it, the value and what to do.

patches/nonfinite.py stops megatron.training with them (it saves a checkpoint so that another device re-runs
the step).
"""

from __future__ import annotations

import re

import torch


def what(message: str) -> str:
    """The value a megatron validation message is about, in a few words."""
    bucket = re.search(r"grad norm for bucket #(\d+)", message)
    return f"the gradient norm of bucket #{bucket.group(1)}" if bucket else "the loss"


def value(text: str) -> str:
    """'tensor(nan)' -> 'nan'."""
    found = re.search(r"tensor\((\S+?)[,)]", text)
    return found.group(1) if found else text


# what megatron's disabled mode raises: "Rank R, node N, device D, iteration I: Unexpected result V (message='M')"
_DISABLED_FAILURE = re.compile(r"Rank (\d+), .*: Unexpected result (.*) \(message='(.*)'\)$", re.S)


def disabled_rejection(error: BaseException) -> tuple[int, str, str] | None:
    """(rank, value, message) of the RuntimeError megatron's machine raises for a rejected result under
    ``--rerun-mode disabled`` (it re-runs nothing, it raises from the loss function); None for another error."""
    found = _DISABLED_FAILURE.search(str(error)) if type(error) is RuntimeError else None
    return None if found is None else (int(found.group(1)), value(found.group(2)), found.group(3))


def mode_named(missing):
    """``RerunMode._missing_``: Megatron-LM's parser offers ``--rerun-mode report_stats`` (its
    RerunStateMachineConfig's word) but its ``initialize_megatron`` looks it up as ``RerunMode("report_stats")``,
    whose value is "report_determinism_stats": a ValueError on every release. The parser's word names that mode."""

    def lookup(cls, given):
        return cls.REPORT_DETERMINISM_STATS if given == "report_stats" else missing(cls, given)

    return lookup


def first_rejection(machine) -> tuple[int, str, str]:
    """(rank, value, message) of the first rank whose result the machine rejected in this step, gathered from
    every rank (a collective: every rank calls it)."""
    call = machine.failed_validation_call
    mine = None if call is None else (torch.distributed.get_rank(), value(str(machine.initial_result)),
                                      call.caller.message)
    found = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(found, mine)
    return next(f for f in found if f is not None)

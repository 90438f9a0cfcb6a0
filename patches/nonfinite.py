"""A non-finite loss or gradient norm ends megatron.training's run with one line, and no non-finite checkpoint.

megatron.training already stops a diverging run through megatron-core's rerun state machine
(``--check-for-nan-in-loss-and-grad``, on by default, ``--rerun-mode validate_results``): a rejected loss or
gradient-bucket norm is re-run in place; reproduced, every rank saves a checkpoint at the last completed
iteration holding the machine's state (so that loading it on another GPU re-runs the step to tell a faulty
device from a real divergence) and exits 16; not reproduced, it exits 17 (a transient fault). What the job
then shows is a series of ERROR lines from every rank ("Need to rerun on a different GPU") and torchrun's
exit status. Built on that, here (``train_step``'s outcome, which every rank shares):

- one line, from rank 0, as megatron's ``train`` exits (after its save): the iteration, the first rank that
  found the value, the value, and what to do;
- the checkpoint megatron saves there holds the weights after the last completed iteration (the stop comes
  before the optimizer step). Those are finite unless a non-finite step got past the machine, which does not
  validate a process's first iteration: so they are checked first, and where any rank holds a non-finite
  weight nothing is saved (exit 17, megatron's "resume from a previous checkpoint");
- the gradient norm the optimizer step returns (the same on every rank) is checked as well: non-finite, the
  optimizer has stepped with it, so the run stops at once (exit 17) before anything can save those weights;
- ``--rerun-mode disabled``: megatron's machine raises a RuntimeError from the loss function (a traceback per
  rank, exit 1); here it ends megatron's ``train`` as the machine's own stop does, exit 17, the line from
  rank 0 (a rank that alone found the value exits 17 silently; the others are ended by the launcher or
  --distributed-timeout-minutes);
- ``--rerun-mode report_stats``, the word megatron's parser offers, names the machine's stats mode (its own
  lookup raises ValueError); that mode re-runs every step and rejects nothing, so the gradient norm stops it.

The exit status, every rank's: 16 only where megatron saved its re-run checkpoint (resume it on another
device to tell a faulty device from a divergence); 17 for every other non-finite stop (nothing was saved
after the last finite iteration: resume from the last checkpoint).
"""

from __future__ import annotations

import functools
import inspect
import math
import sys

import torch

from adapter import nonfinite

_T = "megatron.training.training:"
_line: list[str] = []  # the stop's line, said as ``train`` exits


def _finite_weights(model) -> bool:
    """Whether every rank's model chunks hold finite weights only (a collective)."""
    params = [p for chunk in model for p in chunk.parameters()]
    bad = any(not torch.isfinite(p.detach()).all() for p in params)
    flag = torch.tensor([float(bad)], device=params[0].device if params else "cpu")
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return flag.item() == 0


def _rejected(machine, model, args, saving: bool) -> tuple[bool, str]:
    """(save, the line) for a step the rerun state machine stopped."""
    from megatron.core.rerun_state_machine import RerunState

    rank, value, message = nonfinite.first_rejection(machine)
    at = machine.current_iteration
    found = f"iteration {at}: {nonfinite.what(message)} is {value} on rank {rank} ({message})"
    if machine.state == RerunState.RERUNNING_IN_PLACE:
        return False, (f"{found}; a re-run of the step gave another result: a transient fault. Nothing was saved "
                       f"after iteration {at - 1}: resume from the last checkpoint")
    cause = (f"{found}; a re-run gave it again: the training diverged (lower --lr, now {args.lr:g}) or this "
             f"device is faulty")
    if saving and not _finite_weights(model):
        return False, f"{cause}. The weights are not finite: nothing was saved after iteration {at - 1}"
    if not saving:
        return False, f"{cause}. Resume from a checkpoint saved before the loss diverged"
    return True, (f"{cause}. Megatron-LM saved iteration {at - 1} to {args.save} with its re-run state: loaded on "
                  f"another device it re-runs iteration {at} to tell which (on this one it exits 16 again); to "
                  f"train on, resume from a checkpoint saved before the loss diverged")


def _unchecked(found: tuple[int, str, str], at: int, args) -> str:
    """The line for a value ``--rerun-mode disabled`` rejected: megatron raises it from the loss function,
    before the backward pass and the optimizer step, on each rank that found it."""
    rank, value, message = found
    return (f"iteration {at}: {nonfinite.what(message)} is {value} on rank {rank} ({message}); --rerun-mode "
            f"disabled: not re-run. Nothing was saved after iteration {at - 1}: lower --lr (now {args.lr:g}) and "
            f"resume from the last checkpoint")


def one_line_stop(train_step):
    """``train_step``; where its outcome stops the run (the machine's verdict, or a non-finite gradient norm
    the machine let through), the checkpoint decision above and the line for ``train``'s exit."""
    signature = inspect.signature(train_step)

    @functools.wraps(train_step)
    def step(*args, **kwargs):
        from megatron.core.rerun_state_machine import EXIT_CODE_FAILED_ON_RESULT_VALIDATION, get_rerun_state_machine
        from megatron.training.global_vars import get_args

        try:
            result = train_step(*args, **kwargs)
        except RuntimeError as error:
            found = nonfinite.disabled_rejection(error)
            if found is None:
                raise
            _line[:] = [_unchecked(found, get_rerun_state_machine().current_iteration, get_args())]
            return {}, True, False, True, EXIT_CODE_FAILED_ON_RESULT_VALIDATION, None, None, 0  # megatron's exit
        should_checkpoint, should_exit, exit_code, grad_norm = result[2:6]
        machine, megatron_args = get_rerun_state_machine(), get_args()
        model = signature.bind(*args, **kwargs).arguments["model"]
        if should_exit and machine.failed_validation_call is not None:
            save, line = _rejected(machine, model, megatron_args, should_checkpoint)
        elif grad_norm is not None and not math.isfinite(grad_norm) and megatron_args.check_for_nan_in_loss_and_grad:
            save, line = False, (f"iteration {machine.current_iteration}: the gradient norm is {grad_norm} and the "
                                 f"optimizer stepped with it; nothing was saved after iteration "
                                 f"{machine.current_iteration - 1}: lower --lr (now {megatron_args.lr:g}) and "
                                 f"resume from the last checkpoint")
        else:
            return result
        _line[:] = [line]
        code = exit_code if save else EXIT_CODE_FAILED_ON_RESULT_VALIDATION
        return (*result[:2], save, True, code, *result[5:])

    return step


def said_on_exit(train):
    """megatron's ``train``, whose exit after a stop (``sys.exit``) says the line last, on rank 0."""

    @functools.wraps(train)
    def run(*args, **kwargs):
        try:
            return train(*args, **kwargs)
        except SystemExit:
            if _line and torch.distributed.get_rank() == 0:
                print(f"error: {_line[0]}", file=sys.stderr, flush=True)
            raise

    return run


def register(registry, versions: str) -> None:
    registry.wrap("megatron.core.rerun_state_machine:RerunMode._missing_", nonfinite.mode_named, versions=versions,
                  reason="--rerun-mode report_stats, megatron's parser's word, names REPORT_DETERMINISM_STATS "
                         "(initialize_megatron's RerunMode(args.rerun_mode) raises ValueError for it)")
    registry.wrap(f"{_T}train_step", one_line_stop, versions=versions,
                  reason="a non-finite loss or grad norm: no non-finite checkpoint, and one line for the job")
    registry.wrap(f"{_T}train", said_on_exit, versions=versions,
                  reason="the rerun state machine's stop ends in one line saying what to do, not ERRORs per rank")

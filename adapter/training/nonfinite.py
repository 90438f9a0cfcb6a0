"""Non-finite steps: ``--check-for-nan-in-loss-and-grad`` (on by default), ``--check-for-spiky-loss`` and
``--rerun-mode``, through megatron-core's rerun state machine, as Megatron-LM uses it.

Checked, as Megatron-LM checks them: each micro-batch's loss (NaN, Inf; spiky as a non-fatal check) in the
loss function (``check_loss``, from adapter.training.gpt_step), and each gradient bucket's local norm
before the data-parallel reduction (megatron's DDP, ``check_for_nan_in_grad``). With ``validate_results``
(the default) a rejected result makes every rank re-run the step from the same RNG states and micro-batches
(``RerunDataIterator``); megatron's machine then says whether it reproduced. A non-fatal check (spiky loss)
continues with the re-run step. A fatal one stops the run: every rank leaves before the optimizer step, so
the weights and every checkpoint stay as they were after the last good iteration, and one line from rank 0
names the iteration, the rank, the value and the verdict (in adapter/nonfinite.py's words, which
megatron.training's stop shares: patches/nonfinite.py) (``NonFiniteStep``; exit status 17, megatron's
``EXIT_CODE_FAILED_ON_RESULT_VALIDATION``). Megatron-LM would also save a checkpoint holding the machine's
state so that another GPU re-runs the step; this flow saves no machine state, so it saves nothing and the
job resumes from its last checkpoint.

megatron's machine does not validate the first iteration of a process (no checkpoint may exist to go back
to), so the gradient norm the optimizer step returns, the same on every rank, is checked too
(``check_grad_norm``): that step has been taken, and the run stops before anything saves it.
"""

from __future__ import annotations

import contextlib
import functools
import math
import re

import torch
from megatron.core import tensor_parallel
from megatron.core.rerun_state_machine import (
    EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
    RerunDataIterator,
    RerunDiagnostic,
    RerunErrorInjector,
    RerunMode,
    RerunState,
    destroy_rerun_state_machine,
    get_rerun_state_machine,
    initialize_rerun_state_machine,
)

from adapter.nonfinite import first_rejection, what
from adapter.training import global_vars

SPIKY_LOSS_FACTOR = 10  # Megatron-LM's: a loss 10x the largest of the first 100 is spiky
MODES = {"disabled": RerunMode.DISABLED, "validate_results": RerunMode.VALIDATE_RESULTS,
         "report_stats": RerunMode.REPORT_DETERMINISM_STATS}
# what megatron's disabled mode raises: "Rank R, node N, device D, iteration I: Unexpected result V (message='M')"
_DISABLED_FAILURE = re.compile(r"Rank (\d+), .*: Unexpected result (.*) \(message='(.*)'\)$", re.S)


class NonFiniteStep(RuntimeError):
    """The run stops on a rejected result; ``report`` is True on the one rank that prints the line."""

    exit_code = EXIT_CODE_FAILED_ON_RESULT_VALIDATION

    def __init__(self, line: str, report: bool):
        super().__init__(line)
        self.report = report


def initialize(args, iteration: int) -> None:
    """megatron's machine for the arguments, counting iterations from ``iteration`` (where a --load
    resumes), as Megatron-LM's ``initialize_megatron`` sets it up: the tracker's RNG states are saved and
    restored with a re-run, as the random, numpy, torch and device states are by the machine itself."""
    destroy_rerun_state_machine()  # a process may train more than once (tests, benchmarks)
    initialize_rerun_state_machine(
        state_save_func=lambda: {"tracker": tensor_parallel.get_cuda_rng_tracker().get_states()},
        state_restore_func=lambda state: tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"]),
        mode=MODES[args.rerun_mode],
        error_injector=RerunErrorInjector(error_injection_rate=args.error_injection_rate,
                                          error_injection_type=RerunDiagnostic(args.error_injection_type)))
    get_rerun_state_machine().current_iteration = iteration - 1  # the machine adds 1 as each step starts


def replayable(iterator):
    """The training iterator (one per virtual stage, or None) wrapped so that a re-run replays the step's
    micro-batches."""
    if iterator is None:
        return None
    return [RerunDataIterator(i) for i in iterator] if isinstance(iterator, list) else RerunDataIterator(iterator)


def check_loss(loss: torch.Tensor) -> None:
    """Megatron-LM's checks of one micro-batch's loss (its pretrain_gpt.py ``loss_func``)."""
    args, machine = global_vars.get_args(), get_rerun_state_machine()
    if args.check_for_nan_in_loss_and_grad:
        for reject, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            machine.validate_result(result=loss, rejection_func=reject, tolerance=0.0, fatal=True,
                                    message=f"found {what} in local forward loss calculation")
    if args.check_for_spiky_loss:
        machine.validate_result(
            result=loss, rejection_func=functools.partial(machine.is_unexpectedly_large,
                                                          threshold=SPIKY_LOSS_FACTOR, context="loss"),
            message="Spiky loss", tolerance=0.0, fatal=False)


def _iteration() -> int:
    return get_rerun_state_machine().current_iteration + 1


@contextlib.contextmanager
def one_line():
    """megatron's disabled mode raises a RuntimeError with a traceback from inside the schedule on the rank
    that found the value: one line instead (that rank's; the others may be in the step's collectives, which
    a launcher such as torchrun ends when this rank exits)."""
    try:
        yield
    except RuntimeError as exc:
        failure = _DISABLED_FAILURE.search(str(exc))
        if failure is None:
            raise
        rank, value, message = failure.groups()
        raise NonFiniteStep(f"iteration {_iteration()}, rank {rank}: {what(message)} is {value} ({message}); "
                            f"--rerun-mode disabled: not re-run. Nothing was saved after iteration "
                            f"{_iteration() - 1}", report=True) from None


def forward_backward(run_step, data_iterator):
    """``run_step()`` (zero the gradients, forward and backward) as often as megatron's machine asks; its
    last result. Raises ``NonFiniteStep`` on every rank where the machine says to stop, before the
    optimizer step."""
    machine = get_rerun_state_machine()
    with one_line():
        while machine.should_run_forward_backward(data_iterator):
            result = run_step()
    _, should_exit, _ = machine.should_checkpoint_and_exit()
    if should_exit:
        raise _stopped(machine)
    return result


def _stopped(machine) -> NonFiniteStep:
    """The one line: the first rank whose result was rejected, its value and message (gathered from every
    rank, once), and what the re-run showed."""
    rank, value, message = first_rejection(machine)
    verdict = ("the re-run gave another result: a transient fault; start the job again"
               if machine.state == RerunState.RERUNNING_IN_PLACE else
               "the re-run gave it again: the training diverged (lower --lr, check the data) or this device is "
               "faulty")
    line = (f"iteration {_iteration()}, rank {rank}: {what(message)} is {value} ({message}); {verdict}. "
            f"Nothing was saved after iteration {_iteration() - 1}")
    return NonFiniteStep(line, report=torch.distributed.get_rank() == 0)


def check_grad_norm(grad_norm: float | None) -> None:
    """Stop on a non-finite gradient norm (the optimizer's, reduced over every rank, so the same on all)."""
    if grad_norm is None or math.isfinite(grad_norm) or not global_vars.get_args().check_for_nan_in_loss_and_grad:
        return
    raise NonFiniteStep(f"iteration {_iteration()}, every rank: the gradient norm is {grad_norm}. Nothing was "
                        f"saved after iteration {_iteration() - 1}", report=torch.distributed.get_rank() == 0)


@contextlib.contextmanager
def validation_off():
    """Evaluation runs the loss function outside a training step, where megatron's machine refuses to
    validate: as Megatron-LM's ``evaluate``, the machine is disabled around it (a NaN still stops the run,
    with one line). The mode is set directly: ``set_mode`` logs a warning at every evaluation."""
    machine = get_rerun_state_machine()
    mode, machine.mode = machine.mode, RerunMode.DISABLED
    try:
        with one_line():
            yield
    finally:
        machine.mode = mode

"""scripts/pretrain_gpt.py (megatron.training's own ``pretrain``) as torchrun runs it, with faults a test places:
test-only, never shipped in a launch.

``ADAPTER_TEST_FAULTS`` lists faults separated by commas, each ``GENERATION:RANK:WHAT[:ITERATION]``: in the
generation of that number (torchrun's TORCHELASTIC_RESTART_COUNT), the rank of that number

- ``startup``: is SIGKILLed as it starts megatron's model-parallel groups (its peers are then in ``new_group``);
- ``step:N``: is SIGKILLed as iteration N ends (after megatron's ``training_log``, before its save, if N is one);
- ``save:N``: is SIGKILLed once its part of iteration N's checkpoint is written, before the save is published;
- ``stall:N``: stops answering as iteration N ends (SIGSTOP: alive, silent, its connections open), and is
  SIGKILLed as soon as a SIGTERM waits for it (torchrun stopping the group; torchrun itself would SIGKILL the
  stopped process only after 30 s, which its restart path does not let one shorten);
- ``slow:S``: sleeps S seconds in every iteration from the second on (a straggler).

The faults are placed on megatron.training's functions once scripts/pretrain_gpt.py has chosen where megatron
comes from. Every rank that logs megatron's losses (the last, megatron's ``print_rank_last``) also prints
``loss N: X`` for each iteration, its own loss in megatron's format: megatron's log line after a start-up
averages the first logged iteration in with the next one (``is_first_iteration`` does not reset its sums), so
a resumed run's log differs from an uninterrupted one's where the training does not.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import pretrain_gpt  # noqa: E402 - imports adapter, then megatron

from adapter.checkpoint_dir import checkpoint_name  # noqa: E402


def _faults() -> list[tuple[str, float | None]]:
    """This process's faults: (what, iteration)."""
    mine = []
    for fault in filter(None, os.environ.get("ADAPTER_TEST_FAULTS", "").split(",")):
        generation, rank, what, *iteration = fault.split(":")
        if (generation, rank) == (os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["RANK"]):
            mine.append((what, float(iteration[0]) if iteration else None))
    return mine


def _wrap(owner, name: str, before=None, after=None) -> None:
    original = getattr(owner, name)

    def call(*args, **kwargs):
        if before:
            before(*args, **kwargs)
        result = original(*args, **kwargs)
        if after:
            after(*args, **kwargs)
        return result

    setattr(owner, name, call)


def _iteration(args, kwargs) -> int:
    """The iteration megatron's ``training_log`` is called for (its fourth argument)."""
    return kwargs["iteration"] if "iteration" in kwargs else args[3]


def _signal_at(iteration: int, sig: int):
    return lambda *a, **k: _iteration(a, k) == iteration and os.kill(os.getpid(), sig)


def _print_loss(*args, **kwargs) -> None:
    """``loss N: X``, this iteration's own loss, where megatron logs (the last rank)."""
    import torch

    loss = (kwargs["loss_dict"] if "loss_dict" in kwargs else args[0]).get("lm loss")
    if loss is not None and torch.distributed.get_rank() == torch.distributed.get_world_size() - 1:
        print(f"loss {_iteration(args, kwargs)}: {float(loss):.6E}", flush=True)


# SIGKILLs the process of pid argv[1] once a SIGTERM is pending for it (a stopped process keeps its SIGTERM
# pending when it handles the signal), and ends when that process is gone
_KILL_ON_SIGTERM = f"""
import os, sys, time
pid = int(sys.argv[1])
while True:
    try:
        status = dict(line.split(":", 1) for line in open(f"/proc/{{pid}}/status").read().splitlines())
    except OSError:
        break
    if status["State"].split()[0] in "ZX":
        break
    if (int(status["SigPnd"], 16) | int(status["ShdPnd"], 16)) & 1 << {signal.SIGTERM - 1}:
        try:
            os.kill(pid, {signal.SIGKILL})
        except OSError:
            pass
        break
    time.sleep(0.1)
"""


def _stall_at(iteration: int):
    """SIGSTOP at that iteration, with a watcher in a session of its own (torchrun signals the rank's
    process group) that SIGKILLs the stopped rank once torchrun's SIGTERM waits for it."""
    def stall(*args, **kwargs):
        if _iteration(args, kwargs) == iteration:
            subprocess.Popen([sys.executable, "-c", _KILL_ON_SIGTERM, str(os.getpid())], start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # at worst torchrun's 30 s
            os.kill(os.getpid(), signal.SIGSTOP)
    return stall


def _install(what: str, n: float | None) -> None:
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.training import training

    if what == "startup":
        _wrap(parallel_state, "initialize_model_parallel", before=lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL))
    elif what == "step":
        _wrap(training, "training_log", after=_signal_at(n, signal.SIGKILL))
    elif what == "stall":
        _wrap(training, "training_log", after=_stall_at(n))
    elif what == "slow":
        _wrap(training, "train_step", before=lambda *a, **k: k.get("iteration", 0) > 0 and time.sleep(n))
    elif what == "save":
        name = checkpoint_name(int(n))
        _wrap(dist_checkpointing, "save",
              after=lambda state, directory, *a, **k: name in str(directory) and os.kill(os.getpid(), signal.SIGKILL))
    else:
        raise SystemExit(f"ADAPTER_TEST_FAULTS: unknown fault {what!r}; give startup, step, save, stall or slow")


def _faulted(run_guarded):
    """``run_guarded`` with the faults placed, once scripts/pretrain_gpt.py has chosen where megatron comes from."""

    def run(*args, **kwargs):
        from megatron.training import training

        _wrap(training, "training_log", after=_print_loss)
        for fault in _faults():
            _install(*fault)
        return run_guarded(*args, **kwargs)

    return run


if __name__ == "__main__":
    pretrain_gpt.adapter_run.run_guarded = _faulted(pretrain_gpt.adapter_run.run_guarded)
    pretrain_gpt.leave(pretrain_gpt.main())

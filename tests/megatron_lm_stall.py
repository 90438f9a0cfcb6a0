"""``python -m adapter.run`` as torchrun starts it, with rank 1 stalled: test-only, never shipped. As the
training step of the iteration ``ADAPTER_TEST_STALL_AT`` names begins, rank 1 stops answering (SIGSTOP:
alive, silent, its connections open); its peer then waits in that step's first collective. Arguments: the
script (Megatron-LM's pretrain_gpt.py) and its own."""

from __future__ import annotations

import functools
import os
import signal
import sys

import adapter.run


def _stalling(train_step, at: int):
    @functools.wraps(train_step)
    def step(*args, **kwargs):
        if kwargs.get("iteration") == at - 1:  # megatron counts the iterations done
            os.kill(os.getpid(), signal.SIGSTOP)
        return train_step(*args, **kwargs)

    return step


def _stalled_run(run_routed):
    """``run_routed`` with the fault placed once ``adapter.run`` has chosen where megatron comes from."""

    def run(script):
        from megatron.training import training

        training.train_step = _stalling(training.train_step, int(os.environ["ADAPTER_TEST_STALL_AT"]))
        return run_routed(script)

    return run


if __name__ == "__main__":
    if os.environ.get("RANK") == "1":
        adapter.run.run_routed = _stalled_run(adapter.run.run_routed)
    sys.exit(adapter.run.main(sys.argv[1:]))

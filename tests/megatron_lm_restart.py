"""``python -m adapter.run`` as torchrun starts it, with one fault a test places: test-only, never shipped. In
torchrun's first generation (TORCHELASTIC_RESTART_COUNT 0) rank 1 is SIGKILLed as megatron creates its first
model-parallel group, after the world's group has met in torchrun's store; its peer then waits in
``new_group`` until torchrun restarts both. Arguments: the script (Megatron-LM's pretrain_gpt.py) and its own."""

from __future__ import annotations

import os
import signal
import sys

import torch.distributed

if (os.environ.get("TORCHELASTIC_RESTART_COUNT"), os.environ.get("RANK")) == ("0", "1"):
    torch.distributed.new_group = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)

import adapter.run  # noqa: E402 - after the fault, so that whatever holds new_group holds it

if __name__ == "__main__":
    sys.exit(adapter.run.main(sys.argv[1:]))

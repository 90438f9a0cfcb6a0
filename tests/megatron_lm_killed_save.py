"""``python -m adapter.run`` as torchrun starts it, with one fault a test places: test-only, never shipped. In
torchrun's first generation (TORCHELASTIC_RESTART_COUNT 0) rank 1 is SIGKILLed as it starts writing its part
of iteration 4's checkpoint (rank 0 has made the directory and writes its own); torchrun then restarts both.
Arguments: the script (Megatron-LM's pretrain_gpt.py) and its own."""

from __future__ import annotations

import os
import signal
import sys

import adapter.run  # noqa: I001 - the adapter before megatron
from adapter.core_source import prefer_installed_megatron_core

# as adapter.run's main does before anything imports megatron.core: the installed megatron-core, not the
# checkout's source tree, which lacks the compiled dataset helpers
prefer_installed_megatron_core()
from megatron.core import dist_checkpointing  # noqa: E402

if (os.environ.get("TORCHELASTIC_RESTART_COUNT"), os.environ.get("RANK")) == ("0", "1"):
    _save = dist_checkpointing.save

    def _killed_in_iteration_4(state, directory, *args, **kwargs):
        if "iter_0000004" in str(directory):
            os.kill(os.getpid(), signal.SIGKILL)
        return _save(state, directory, *args, **kwargs)

    dist_checkpointing.save = _killed_in_iteration_4

if __name__ == "__main__":
    sys.exit(adapter.run.main(sys.argv[1:]))

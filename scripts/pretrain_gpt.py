"""Pretrain a GPT / Qwen model through megatron.training's own ``pretrain``, as Megatron-LM's
``pretrain_gpt.py`` does, with the device adapter imported first:

    torchrun --nproc_per_node 4 scripts/pretrain_gpt.py --model qwen2.5-tiny \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --micro-batch-size 2 \\
        --global-batch-size 8 --train-iters 100 --lr 1e-3 --mock-data --eval-interval 50

Every flag is Megatron-LM's, with its meaning and default; ``--model NAME`` stands for NAME's architecture
flags (``flow.model_flags``). The same command runs on CPUs (gloo), NVIDIA GPUs (NCCL) and Ascend NPUs
(HCCL); the adapter picks. It ends as ``python -m adapter.run`` ends Megatron-LM's own script: a refused
setting is one line and exit 2, a failed save one line and exit 1.
"""

from __future__ import annotations

import time

_PROGRAM_START = time.time()

import gc  # noqa: E402

if __name__ == "__main__":
    gc.disable()  # until the imports are done: see _imported

import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runnable from a checkout
os.environ["ADAPTER_COMPILE_PROBE"] = "1"  # inductor's CPU probe beside the imports (adapter/compile_probe.py)

import adapter  # noqa: E402,F401  - before megatron
from adapter import compile_probe  # noqa: E402
from adapter import run as adapter_run  # noqa: E402

compile_probe.start_if_requested()  # where the adapter was imported before this script, it starts here


def main() -> int:
    try:
        adapter_run.check_megatron_lm()  # megatron-core 0.16.1: megatron.training from a checkout
    except adapter_run.LaunchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.status
    adapter_run.prefer_installed_megatron_core()
    from megatron.training import set_startup_timestamps

    set_startup_timestamps(program_start=_PROGRAM_START, main_entry=time.time())
    from flow import pretrain

    _imported()
    compile_probe.wait()  # before megatron forks its data loader workers (adapter/compile_probe.py)
    return adapter_run.run_guarded(pretrain.run, sys.argv[1:])


def _imported() -> None:
    """Python's cyclic garbage collector back on once the imports are done, with what they made (some 470,000
    objects: modules, classes, functions) moved out of its reach (``gc.freeze``). Left on through the
    imports, its full collections walk the growing heap again and again, and after them every full
    collection of the run walks it once more: 0.8 s of a tiny model's start-up on the cpu backend
    (bench/startup.py). What the imports left as garbage cycles (about 11,000 objects, no measurable memory)
    stays; nothing else changes."""
    gc.freeze()
    gc.enable()


def leave(status: int) -> None:
    """End the process with ``status`` once its groups are torn down and Python's exit handlers have run,
    without the interpreter's own teardown. megatron's objects keep gloo groups alive past
    ``destroy_process_group`` (their threads still run), and destroying them in that teardown can abort the
    process in a C++ thread (``terminate called without an active exception``), which a launcher takes for a
    failed rank."""
    import atexit

    import torch

    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    atexit._run_exitfuncs()  # logging's flush, torch's compile workers, multiprocessing's children
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    leave(main())

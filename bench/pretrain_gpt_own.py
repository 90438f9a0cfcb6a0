"""Pretrain a GPT / Qwen model with megatron-core through the device adapter, as Megatron-LM's
``pretrain_gpt.py`` does: the model provider, the dataset provider and the forward step, handed to
``pretrain``. The step (model provider, loss, forward step) lives in ``adapter.training.gpt_step``; this
file is the entry point only. Megatron-LM's arguments, plus ``--model NAME`` for a named config:

    torchrun --nproc_per_node 4 scripts/pretrain_gpt.py --model qwen2.5-tiny \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --micro-batch-size 2 \\
        --global-batch-size 8 --train-iters 100 --lr 1e-3 --mock-data

The same command runs on CPUs (gloo), NVIDIA GPUs (NCCL) and Ascend NPUs (HCCL); the adapter picks.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runnable from a checkout

import adapter  # noqa: E402,F401  - before megatron
from adapter.training import compile_probe  # noqa: E402

compile_probe.probe_in_background()  # torch.compile's CPU probe beside the imports below, not in iteration 1

from megatron.core.enums import ModelType  # noqa: E402

from adapter.training import gpt_step  # noqa: E402
from adapter.training.arguments import ArgumentError  # noqa: E402
from adapter.training.data import train_valid_test_datasets_provider  # noqa: E402
from adapter.training.nonfinite import NonFiniteStep  # noqa: E402
from adapter.training.pretrain import pretrain  # noqa: E402
from adapter.shared_outcome import StepFailed  # noqa: E402


def main(argv=None) -> int:
    try:
        pretrain(train_valid_test_datasets_provider, gpt_step.model_provider, ModelType.encoder_or_decoder,
                 gpt_step.forward_step, argv=argv)
    except ArgumentError as exc:  # found once ranks are running (e.g. datasets that cannot be built)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except StepFailed as exc:  # a save that failed: every rank stops with the one error
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except NonFiniteStep as exc:  # a NaN / Inf loss or gradient norm: one line, nothing saved after it
        if exc.report:
            print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


def leave(status: int) -> None:
    """End the process with ``status`` once its groups are torn down and Python's exit handlers have run,
    without the interpreter's own teardown. megatron's objects keep gloo groups alive past
    ``destroy_process_group`` (their threads still run), and destroying them in that teardown can abort the
    process in a C++ thread (``terminate called without an active exception``: 2 exits in 10 after a preempted
    save on 2 gloo ranks), which a launcher takes for a failed rank."""
    import atexit
    import os

    import torch

    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    atexit._run_exitfuncs()  # logging's flush, torch's compile workers, multiprocessing's children
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    leave(main())

"""Pretrain a GPT / Qwen model through megatron.training's own ``pretrain``, as Megatron-LM's
``pretrain_gpt.py`` does, with the device adapter imported first (issue 50 point 1, prototype):

    torchrun --nproc_per_node 4 scripts/pretrain_gpt.py --model qwen2.5-tiny \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --micro-batch-size 2 \\
        --global-batch-size 8 --train-iters 100 --lr 1e-3 --mock-data --eval-interval 50

Every flag is Megatron-LM's, with its meaning and default; ``--model NAME`` stands for NAME's architecture
flags (``flow.model_flags``). The model is megatron.training's own GPT build from those arguments
(``gpt_config_from_args``), so the same flags build the same model as Megatron-LM's script.
"""

from __future__ import annotations

import time

_PROGRAM_START = time.time()

import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runnable from a checkout

import adapter  # noqa: E402,F401  - before megatron
from adapter.cuda_only_features import RefusedSetting  # noqa: E402
from flow import gpt, model_flags  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.training import pretrain, set_startup_timestamps  # noqa: E402
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args  # noqa: E402
from megatron.training.arguments import parse_and_validate_args  # noqa: E402
from models.config import ModelConfigError  # noqa: E402


def main() -> int:
    set_startup_timestamps(program_start=_PROGRAM_START, main_entry=time.time())
    try:
        sys.argv[1:] = model_flags.expand(sys.argv[1:])
        args = parse_and_validate_args(args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
        container = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
        pretrain(container, gpt.train_valid_test_datasets_provider, ModelType.encoder_or_decoder,
                 gpt.forward_step)
    except (RefusedSetting, ModelConfigError) as exc:  # bad input (the adapter's refusals): one line, exit 2
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def leave(status: int) -> None:
    """End the process with ``status`` once its groups are torn down and Python's exit handlers have run,
    without the interpreter's own teardown, in which destroying gloo groups that megatron's objects keep
    alive can abort the process in a C++ thread (today's flow's exit, kept)."""
    import atexit

    import torch

    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    leave(main())

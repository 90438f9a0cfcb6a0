"""megatron.training's own ``pretrain`` on the GPT step of ``flow.gpt``: what Megatron-LM's
``pretrain_gpt.py`` main block does, for the release installed (``flow.releases``), with the hybrid models
built by the project's builder (``flow.hybrid``). ``scripts/pretrain_gpt.py`` calls ``run``."""

from __future__ import annotations

import functools
import os
import socket
import sys

from flow import gpt, hybrid, model_flags, releases


def run(argv: list[str]) -> None:
    """Train as Megatron-LM's ``pretrain_gpt.py`` would on ``argv``, ``--model NAME`` expanded first."""
    _one_process_world()
    sys.argv[1:] = model_flags.expand(argv)
    name = model_flags.name(argv)
    model_inputs = functools.partial(hybrid.pretrain_inputs, name=name) if hybrid.named(name) else None
    releases.pretrain_gpt(gpt.train_valid_test_datasets_provider, gpt.forward_step, model_inputs)


def _one_process_world() -> None:
    """A command started without a launcher (no WORLD_SIZE: plain ``python scripts/pretrain_gpt.py``) trains
    as a world of one, as ``adapter.init_distributed`` makes one: megatron.training's env:// rendezvous
    would otherwise stop on the missing MASTER_ADDR. The port is a free one of this host's."""
    if "WORLD_SIZE" in os.environ:
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))

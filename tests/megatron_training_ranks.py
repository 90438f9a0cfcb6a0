"""Rank functions that drive the megatron-core wheel's megatron.training (0.17+) directly, as Megatron-LM's
pretrain does, with no Megatron-LM checkout: its arguments parsed and checked by its own parser, its own
``_initialize_distributed``, its own ``train_step`` over a rerun state machine."""

from __future__ import annotations

import datetime
import os
import sys
import time
import types
from unittest import mock

import adapter  # noqa: F401 - before megatron
import torch

ARGV = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3",
        "--train-iters", "4", "--eval-interval", "2", "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "256"]


def megatron_args(argv: list[str]):
    """Megatron-LM's arguments for ``ARGV`` + ``argv``, as its ``initialize_megatron`` parses and checks
    them, set as its global arguments."""
    from megatron.training import arguments, global_vars

    with mock.patch.object(sys, "argv", ["pretrain_gpt.py", *ARGV, *argv]):
        args = arguments.validate_args(arguments.parse_args())
    global_vars.set_args(args)
    return args


def stall_after_initialize(timeout_minutes: float) -> None:
    """megatron.training's ``_initialize_distributed`` (its model-parallel groups) at TP 2; then rank 1 stops
    answering, and rank 0 waits in an all-reduce on megatron's tensor-parallel group, which the watch ends (it
    never returns)."""
    from megatron.core import parallel_state
    from megatron.training import initialize

    args = megatron_args(["--tensor-model-parallel-size", "2"])
    args.distributed_timeout_minutes = timeout_minutes  # Megatron-LM's flag takes whole minutes: a test's seconds
    # the world meets with time to spare for two interpreters starting on a loaded host (megatron's own start
    # then keeps it, as it keeps a caller's); megatron's groups and the watch get the seconds above
    torch.distributed.init_process_group("gloo", timeout=datetime.timedelta(minutes=1))
    initialize._initialize_distributed(None, None, None)
    if torch.distributed.get_rank() == 1:  # silent for three timeouts, then gone without a word
        time.sleep(timeout_minutes * 60 * 3)
        os._exit(0)
    torch.distributed.all_reduce(torch.ones(2), group=parallel_state.get_tensor_model_parallel_group())
    print("the all-reduce returned", flush=True)
    os._exit(0)


class _Chunk(torch.nn.Module):
    """A model chunk as ``train_step`` handles one before the optimizer step (megatron's DDP's buffer calls)."""

    def __init__(self, weight: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.full((2,), weight))
        self.force_all_reduce = False

    def zero_grad_buffer(self):
        pass


def _losses(values: list[float]):
    """A ``forward_backward_func`` whose loss, validated as Megatron-LM's loss function validates it, is the
    next of ``values`` at each run of the step."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    remaining = iter(values)

    def forward_backward(**kwargs):
        get_rerun_state_machine().validate_result(
            result=torch.tensor(next(remaining)), rejection_func=torch.isnan, tolerance=0.0, fatal=True,
            message="found NaN in local forward loss calculation")
        return []

    return forward_backward


def nonfinite_step(save: str) -> dict:
    """megatron.training's own ``train_step`` (wrapped: patches/nonfinite.py) at iteration 3 of a run whose
    rerun state machine validates results: a NaN loss reproduced by the re-run with finite weights, the same
    with a NaN weight, and a NaN the re-run does not reproduce. Per case: (should_checkpoint, should_exit,
    exit code) and the line the run ends with."""
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
    from megatron.core.rerun_state_machine import (RerunMode, destroy_rerun_state_machine, get_rerun_state_machine,
                                                   initialize_rerun_state_machine)
    from megatron.training import global_vars, training

    from patches import nonfinite

    args = megatron_args(["--save", save, "--save-interval", "2"])
    global_vars._set_timers(args)
    init_num_microbatches_calculator(0, None, args.global_batch_size, args.micro_batch_size, 1)
    torch.distributed.init_process_group("gloo")
    outcomes = {}
    nan = float("nan")
    for case, weight, losses in (("reproduced", 1.0, [nan, nan]), ("nan weight", nan, [nan, nan]),
                                 ("transient", 1.0, [nan, 2.0])):
        destroy_rerun_state_machine()
        initialize_rerun_state_machine(mode=RerunMode.VALIDATE_RESULTS)
        machine = get_rerun_state_machine()
        machine.current_iteration, machine.first_iteration_complete = 2, True  # as train() leaves it after 2 steps
        result = training.train_step(None, None, [_Chunk(weight)], types.SimpleNamespace(zero_grad=lambda: None),
                                     None, None, _losses(losses), iteration=2)
        outcomes[case] = (list(result[2:5]), nonfinite._line[0])
    return outcomes


def exit_signal_stop(save: str) -> dict:
    """megatron.training's own ``checkpoint_and_decide_exit`` (wrapped: patches/early_exit.py) after iteration 5,
    its checkpoint writer stubbed: with nothing received, then after SIGTERM reached the process, with and
    without --save. Per case: (stops, the iterations megatron saved, what the process printed)."""
    import contextlib
    import io
    import signal

    from megatron.training import global_vars, training

    args = megatron_args(["--exit-signal-handler", "--save", save, "--save-interval", "1000"])
    global_vars._set_timers(args)
    global_vars._set_signal_handler(args.exit_signal)
    torch.distributed.init_process_group("gloo")
    outcomes = {}
    for case in ("nothing received", "SIGTERM", "SIGTERM without --save"):
        args.save = None if case.endswith("without --save") else save
        if case.startswith("SIGTERM"):
            os.kill(os.getpid(), signal.SIGTERM)
        saved, printed = [], io.StringIO()
        with (mock.patch.object(training, "save_checkpoint_and_time", lambda i, *a, **k: saved.append(i)),
              contextlib.redirect_stdout(printed)):
            stops = training.checkpoint_and_decide_exit(None, None, None, 5, 0.0, {}, None)
        outcomes[case] = (stops, saved, [line for line in printed.getvalue().splitlines() if "[adapter]" in line])
    return outcomes


def expert_load_log(experts: int, topk: int) -> dict:
    """megatron.training's own ``training_log`` (wrapped: patches/expert_load.py) at --log-interval 2 over two
    real megatron routers (layers 1 and 2) the wrapped ``setup_model_and_optimizer`` handed over: iteration 1
    (megatron's first, logged without a new count), then 2. Before each, a training forward of each router, an
    evaluation forward and a forward without autograd (neither counts). Returns the top-k experts each training
    forward chose (megatron's gating over the inputs, read apart from the routing map), what the process printed
    at each iteration, the TensorBoard scalars, and what a dense model's setup leaves (no load)."""
    import contextlib
    import io

    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.training import arguments, global_vars, training

    from patches import expert_load

    args = megatron_args(["--num-experts", str(experts), "--moe-router-topk", str(topk), "--moe-ffn-hidden-size", "64",
                         "--log-interval", "2", "--moe-per-layer-logging"])
    args.padded_vocab_size = args.vocab_size  # what building the tokenizer sets, for the line's FLOPs
    global_vars._set_timers(args)
    global_vars._set_energy_monitor(args)
    init_num_microbatches_calculator(0, None, args.global_batch_size, args.micro_batch_size, 1)
    torch.distributed.init_process_group("gloo")
    parallel_state.initialize_model_parallel()
    config = arguments.core_transformer_config_from_args(args)
    groups = ProcessGroupCollection.use_mpu_process_groups()
    routers = torch.nn.ModuleList([TopKRouter(config, groups), TopKRouter(config, groups)])
    for number, router in enumerate(routers, 1):
        router.set_layer_number(number)
    expert_load.counted(lambda *a, **k: ([routers], None, None))()
    scalars: dict = {}
    global_vars._GLOBAL_TENSORBOARD_WRITER = types.SimpleNamespace(
        add_scalar=lambda name, value, step: scalars.setdefault(name, {}).__setitem__(step, value))
    chosen, printed = [], {}
    global_vars.get_timers()("interval-time", log_level=0).start(barrier=True)  # as train() starts it
    for iteration in (1, 2):
        for router in routers:
            hidden = torch.randn(3, 2, args.hidden_size)
            router(hidden)
            chosen.append([router.layer_number, torch.topk(router.gating(hidden), topk).indices.flatten().tolist()])
            with torch.no_grad():
                router(hidden)
            router.eval()
            router(hidden)
            router.train()
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            training.training_log({"lm loss": torch.tensor([1.0])}, {}, 1e-3, iteration, 1.0, False, 0, 1.0,
                                  None, None, None, is_first_iteration=iteration == 1)
        printed[iteration] = out.getvalue()
    args.num_experts = None
    expert_load.counted(lambda *a, **k: ([routers], None, None))()
    return {"chosen": chosen, "printed": printed, "scalars": scalars, "dense": list(expert_load._load)}

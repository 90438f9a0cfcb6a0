"""Bad input to megatron.training ends in one line for the job and exit status 2 on every rank, not in a
traceback from every rank (issue 50): for scripts/pretrain_gpt.py, for Megatron-LM's pretrain_gpt.py through
``python -m adapter.run``, and so for any script that calls megatron.training's ``pretrain``.

Megatron-LM checks its arguments with some 180 bare or messaged ``assert``s (and a few ``ValueError``s) in
``validate_args``; every rank fails the same one. Its message is the reason: ``refusal`` says it in one line,
with the arguments the failed check reads and their values (a bare ``assert`` is said by its condition).
Two things it does not check fail later, with a traceback from every rank and a hang or a peer's
``Connection closed by peer``: a missing ``--eval-interval`` (a TypeError sizing the validation set), and a
``--data-path`` whose files are not there, or whose tokens are not the run's vocabulary (``adapter.corpus_check``).
Each becomes an ``InputRefused``; ``adapter.run``'s ``run_refusing`` turns it into rank 0's line and exit 2
on every rank. The registry entries are patches/input_refusals.py.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import io
import linecache
import os
import re
import sys
from pathlib import Path

import torch

from adapter import checkpoint_dir, checkpoint_unpickling
from adapter.corpus_check import check_corpus, check_files
from adapter.cuda_only_features import RefusedSetting

# What megatron raises for input it refuses; anything else (a TypeError, a KeyError) is a fault of code
CHECK_FAILURES = (AssertionError, ValueError, RuntimeError, NotImplementedError)
_PER_SPLIT = ("--train-data-path", "--valid-data-path", "--test-data-path")


class InputRefused(RefusedSetting):
    """Input megatron.training cannot train on (arguments, data), said in one line for the job."""


def refusal(exc: BaseException, args, owner: str = "args",
            checker: str = "Megatron-LM's validate_args") -> InputRefused | None:
    """The one line for ``exc``, a check of megatron's own (``CHECK_FAILURES`` raised in a ``megatron.``
    module) that failed on ``args``: the arguments its check reads (``owner.NAME``: ``args.`` in validate_args,
    ``self.`` in a config megatron builds from the arguments of the same names) and those that made the check
    apply, with their values, then megatron's message, or its condition where the ``assert`` has none (as
    ``checker`` requires it). None for anything else, which keeps its traceback."""
    tb = _raising_frame(exc)
    if (isinstance(exc, RefusedSetting) or not isinstance(exc, CHECK_FAILURES) or tb is None
            or not tb.tb_frame.f_globals.get("__name__", "").startswith("megatron.")):
        return None
    test, guard = _failed_check(tb.tb_frame.f_code.co_filename, tb.tb_lineno)
    names = [name for name in _names(guard, owner) if getattr(args, name, None)] + _names(test, owner)
    names = [name for name in names if owner == "args" or hasattr(args, name)]
    reason = " ".join(str(exc).split())
    if not reason:
        reason = f"{checker} requires {_condition(test, owner) if test else 'what an assertion says'}"
        reason += f" when {_condition(guard, owner)}" if guard else ""
    given = ", ".join(as_given(name, args) for name in dict.fromkeys(names))
    return InputRefused(f"{given}: {reason}" if given else reason)


def config_refusal(exc: BaseException, args) -> InputRefused | None:
    """``refusal`` for a check of megatron-core's ``TransformerConfig``, which megatron.training builds from
    the arguments (``core_transformer_config_from_args``) after ``validate_args``: its fields are the
    arguments of the same names."""
    return refusal(exc, args, owner="self", checker="megatron-core's TransformerConfig")


def tokenizer_refusal(exc: BaseException, args) -> InputRefused | None:
    """``refusal`` for a check of megatron's tokenizer building (a missing or unreadable --tokenizer-model),
    said with the tokenizer arguments it was built from."""
    refused = refusal(exc, args)
    if refused is None:
        return None
    given = ", ".join(as_given(name, args) for name in ("tokenizer_type", "tokenizer_model"))
    return InputRefused(f"{given}: {refused}")


# megatron-core's dist_checkpointing, a saved tensor the run cannot read (strategies/torch.py, every rank)
# (raised inside torch.distributed.checkpoint's planning, which wraps it in a CheckpointException with its text)
_SHAPE = re.compile(r"Global shape mismatch for loaded \((.*?)\) and expected \((.*?)\) tensor for key (.+)")
# (megatron-core's loader for torch_dist; torch DCP's planner for fsdp_dtensor and torch_dcp)
_MISSING = re.compile(r"KeyError: '?(\S+) from model not in state dict|"
                      r"Error: Missing key in checkpoint state_dict: (\S+?)\.?$", re.M)
# megatron-core's optimizer state of another split (ChainedOptimizer: the experts' optimizer of its own at
# expert parallel size > 1) read into this run's: the dist-ckpt keys' chained_N. prefix, or the structure
_CHAINED = re.compile(r"[\"']chained_\d+\.[^\"']* from model not in state dict|from model not in state dict: "
                      r"\[[^\]]*'chained_\d+\.|Expected \d+ entries in state dict, but got \d+")


def checkpoint_refusal(exc: BaseException, args) -> InputRefused | checkpoint_unpickling.UntrustedCheckpoint | None:
    """A pickle of the checkpoint that the allow-list refused (adapter.checkpoint_unpickling), wherever DCP
    gathered it; ``refusal`` for a check of megatron.training's ``load_checkpoint`` itself (its frame: an error from the
    readers below keeps its traceback), with the ways out where megatron names none: an optimizer state
    sharded for one (TP, PP) read at another. Any failure on a checkpoint whose files say another format than
    the run's is that format's line; an optimizer state of another expert split (megatron-core's
    ChainedOptimizer) is one line with the ways out; a tensor the checkpoint holds in another shape, or lacks
    (megatron-core's loader, torch DCP's planner), is one line naming it: the checkpoint is of another model."""
    untrusted = checkpoint_unpickling.untrusted_in(exc)
    if untrusted is not None:
        return untrusted
    text = f"{type(exc).__name__}: {exc}"
    other_format = _other_format(args)
    if other_format is not None:
        return other_format
    if _CHAINED.search(text) or _single_optimizer_given_a_chained_state(exc):
        return InputRefused(f"--load {args.load}: the checkpoint's optimizer state is split into another number "
                            "of optimizers than this run's (megatron-core gives the experts an optimizer of their "
                            "own when they are sharded apart from the rest, as at --expert-model-parallel-size > 1, "
                            "and loads an optimizer state only into the split that saved it): resume at the "
                            "expert parallel layout that saved it, or load the weights alone with --no-load-optim "
                            "(a fresh optimizer and learning-rate schedule)")
    unreadable = _SHAPE.search(text) or _MISSING.search(text)
    if unreadable is not None:
        what = (f"holds {unreadable[3]} as {unreadable[1]}, this run's is {unreadable[2]}" if unreadable.re is _SHAPE
                else f"lacks {unreadable[1] or unreadable[2]}, which this run reads")
        return InputRefused(f"--load {args.load}: the checkpoint {what}: another model (its vocabulary, sizes or "
                            "layers) saved it; load it with the model and flags that saved it")
    tb = _raising_frame(exc)
    if tb is None or tb.tb_frame.f_globals.get("__name__") != "megatron.training.checkpointing":
        return None
    refused = refusal(exc, args, checker="megatron.training's load_checkpoint")
    if refused is not None and "(TP, PP) mismatch" in str(refused):
        refused = InputRefused(f"{refused} To resume here: --no-load-optim (the weights, a fresh optimizer), or "
                               "resume at the checkpoint's (TP, PP); Megatron-LM saves an optimizer state any "
                               "layout reads with --dist-ckpt-optim-fully-reshardable")
    return refused


# megatron.training tells a checkpoint's format by its files (checkpointing._get_checkpoint_format) and reads
# it with that format's state dict; the run's own is its --ckpt-format's, and Megatron-FSDP's (fsdp_dtensor) is
# built unlike the others. Per format on disk: the --ckpt-format values that read it, what says so, the flags.
# (A legacy torch checkpoint, mp_rank_* files, is read by a run of any format: megatron's conversion path.)
_ON_DISK = {"torch_dist": (("torch_dist",), "megatron's metadata.json, a torch_dist checkpoint",
                           "--ckpt-format torch_dist, without --use-megatron-fsdp"),
            "dcp": (("fsdp_dtensor", "torch_dcp"), "torch's DCP files without megatron's metadata.json, an "
                    "fsdp_dtensor or torch_dcp checkpoint", "--use-megatron-fsdp --ckpt-format fsdp_dtensor "
                    "(Megatron-FSDP's), or --ckpt-format torch_dcp (FSDP2's)")}


def _other_format(args) -> InputRefused | None:
    """A load that failed on a checkpoint whose files say another format than the run's --ckpt-format (a
    Megatron-FSDP fsdp_dtensor checkpoint in a torch_dist run, or the other way): the reason, in one line."""
    directory = _checkpoint_directory(args)
    if directory is None:
        return None
    if (directory / checkpoint_dir.METADATA_FILE).exists():
        on_disk = "torch_dist"
    elif checkpoint_dir.is_complete(directory) and not any(p.name.startswith("mp_rank_0")
                                                           for p in directory.iterdir()):
        on_disk = "dcp"
    else:
        return None
    readers, files, flags = _ON_DISK[on_disk]
    if args.ckpt_format in readers:
        return None
    return InputRefused(f"--load {args.load}: {directory.name} holds {files}, and this run reads --ckpt-format "
                        f"{args.ckpt_format}: load it with the flags that saved it ({flags})")


def _checkpoint_directory(args) -> Path | None:
    """The iteration directory megatron.training loads from ``args.load``: --ckpt-step's, or the tracker's (read
    here without megatron's all-reduce over ranks, and without adapter.checkpoint_dir's checks, which raise:
    this runs where a load failed, and that failure is the one to keep)."""
    if not getattr(args, "load", None):
        return None
    load, step = Path(args.load), getattr(args, "ckpt_step", None)
    if step is None:
        tracker = load / checkpoint_dir.TRACKER
        step = tracker.read_text().strip() if tracker.is_file() else ""
    if str(step) != checkpoint_dir.RELEASE and not str(step).isdigit():
        return None
    directory = load / checkpoint_dir.checkpoint_name(step)
    return directory if directory.is_dir() else None


def _single_optimizer_given_a_chained_state(exc: BaseException) -> bool:
    """A KeyError for 'optimizer' in megatron-core's distributed optimizer's ``load_state_dict``: it was handed
    a ChainedOptimizer's state (one entry per optimizer), whose fully reshardable tensors loaded unprefixed."""
    tb = _raising_frame(exc)
    return (isinstance(exc, KeyError) and exc.args == ("optimizer",) and tb is not None
            and tb.tb_frame.f_globals.get("__name__") == "megatron.core.optimizer.distrib_optimizer")


def refused_call(call, to_refusal, args, failures: tuple = CHECK_FAILURES):
    """``call()``; where it fails one of megatron's checks (``failures``) that ``to_refusal(exc, args)`` turns
    into an ``InputRefused``, that refusal instead; anything else keeps its traceback."""
    try:
        return call()
    except failures as exc:
        refused = to_refusal(exc, args)
        if refused is None:
            raise
        raise refused from exc


def _raising_frame(exc: BaseException):
    """The innermost traceback entry of ``exc``: where the failed check stands."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb


def _names(test: ast.expr | None, owner: str = "args") -> list[str]:
    """The ``owner.NAME`` a condition reads."""
    return [node.attr for node in ast.walk(test) if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name) and node.value.id == owner] if test else []


def _condition(test: ast.expr, owner: str = "args") -> str:
    return ast.unparse(test).replace(f"{owner}.", "")


def _failed_check(filename: str, lineno: int) -> tuple[ast.expr | None, ast.expr | None]:
    """(the condition whose failure raised at ``lineno``, the one it was checked under): an ``assert``'s
    test and that of the innermost ``if`` around it, or the test of the ``if`` whose body raised."""
    try:
        tree = ast.parse("".join(linecache.getlines(filename)))
    except (SyntaxError, ValueError):
        return None, None
    asserts = [node for node in ast.walk(tree) if isinstance(node, ast.Assert)
               and node.lineno <= lineno <= node.end_lineno]
    guards = [node for node in ast.walk(tree) if isinstance(node, ast.If)
              and node.body[0].lineno <= lineno <= node.body[-1].end_lineno]
    guard = max(guards, key=lambda node: node.lineno).test if guards else None
    if asserts:
        return max(asserts, key=lambda node: node.lineno).test, guard
    return guard, None


@functools.cache
def _flags() -> dict[str, argparse.Action]:
    """Megatron-LM's option for each argument name (``hidden_size``: ``--hidden-size``)."""
    from megatron.training.arguments import add_megatron_arguments

    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    return {action.dest: action for action in reversed(parser._actions) if action.option_strings}


def flag_defaults() -> dict:
    """Every argument of the installed release's Megatron-LM parser at its default."""
    return {name: action.default for name, action in _flags().items()}


def flag_default(name: str):
    """The default of Megatron-LM's flag for argument ``name`` (None for a value no flag sets)."""
    return flag_defaults().get(name)


def as_given(name: str, args) -> str:
    """``--hidden-size 64``, ``--bf16``, ``without --bf16``, ``--eval-interval unset``; a value no flag sets
    (megatron derives it) as ``name=value``."""
    value, action = getattr(args, name, None), _flags().get(name)
    if action is None:
        return f"{name}={value}"
    flag = action.option_strings[0]
    if isinstance(action.const, bool):  # store_true / store_false: the flag given or not
        return flag if value == action.const else f"without {flag}"
    if value is None:
        return f"{flag} unset"
    return f"{flag} {' '.join(map(str, value)) if isinstance(value, (list, tuple)) else value}"


def check_schedule(args) -> None:
    """megatron.training sizes the validation set as ``train_iters // eval_interval`` (get_train_valid_test_
    num_samples) unless it only evaluates or validates in full: without --eval-interval that is a TypeError
    on every rank, after the model is built, and at zero or below a ZeroDivisionError or an empty validation."""
    if (args.eval_interval is None and not args.skip_train and not getattr(args, "full_validation", False)
            and not getattr(args, "perform_rl_step", False)):  # RL builds no datasets
        raise InputRefused("--eval-interval is not set: Megatron-LM's training needs it to size and schedule "
                           "validation (pass --eval-interval N; with --eval-iters 0 nothing is evaluated)")
    if args.eval_interval is not None and args.eval_interval <= 0:  # the same division, by zero
        raise InputRefused(f"--eval-interval {args.eval_interval}: must be positive (validation runs every N "
                           "iterations; with --eval-iters 0 nothing is evaluated)")


# Megatron-LM's size arguments megatron.training takes at zero or below without a check of its own, and fails
# on later with a traceback on every rank: in a division inside validate_args itself (the parallel sizes, the
# heads), in TransformerConfig (the layers), or in a tensor's shape as the model is built (the rest)
_POSITIVE = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
             "expert_model_parallel_size", "expert_tensor_parallel_size", "num_attention_heads", "num_layers",
             "hidden_size", "kv_channels", "seq_length")


def check_sizes(args) -> None:
    """Each of ``_POSITIVE`` given is positive; run before megatron's ``validate_args``, which divides by some."""
    for name in _POSITIVE:
        value = getattr(args, name, None)
        if value is not None and value <= 0:
            raise InputRefused(f"{as_given(name, args)}: must be positive")


def check_moe_routing(args) -> None:
    """megatron-core's TransformerConfig divides the experts into --moe-router-num-groups groups: for a dense
    model (no --num-experts) that is a TypeError on every rank as the config is built."""
    if getattr(args, "moe_router_num_groups", None) and not getattr(args, "num_experts", None):
        given = [name for name in ("moe_router_num_groups", "moe_router_group_topk") if getattr(args, name, None)]
        raise InputRefused(f"{', '.join(as_given(name, args) for name in given)} without --num-experts: "
                           "group-limited routing chooses among experts; pass --num-experts N for a mixture of "
                           "experts, or leave the routing flags out for a dense model")


def check_offload_fraction(args) -> None:
    """megatron-core's HybridDeviceOptimizer places parameters' states on the host until their share of the
    whole reaches --optimizer-offload-fraction: neither it nor ``validate_args`` checks the share, so 1.5 trains
    as 1 and -0.5 as 0, each without a word."""
    fraction = getattr(args, "optimizer_offload_fraction", None)
    if getattr(args, "optimizer_cpu_offload", False) and fraction is not None and not 0 <= fraction <= 1:
        raise InputRefused(f"--optimizer-offload-fraction {fraction}: the share of the optimizer's state kept on "
                           "the host, from 0 to 1 (1: all of it)")


def check_manual_gc(args) -> None:
    """megatron.training asserts a non-negative --manual-gc-interval as training starts, after the model is
    built, outside ``validate_args``: a bare traceback on every rank."""
    if getattr(args, "manual_gc", False) and args.manual_gc_interval < 0:
        raise InputRefused(f"--manual-gc-interval {args.manual_gc_interval}: must be 0 or more (0: no collection "
                           "between training steps; N: one every N steps)")


def usage_error_refused(parse):
    """``parse()``, megatron.training's ``parse_args``; argparse's usage error there (an unknown flag, a value
    its type refuses), which every rank would print with megatron's whole usage, some thousand flags, is
    argparse's message as an ``InputRefused``: rank 0's one line, exit status 2 on every rank (adapter.run).
    What else the parse prints on stderr comes out after it, as it was."""
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            return parse()
    except SystemExit as exc:
        message = captured.getvalue().rpartition(": error: ")[2].strip()
        if exc.code != 2 or not message:
            raise
        captured = io.StringIO()  # said in the refusal
        raise InputRefused(f"{message} (--help lists the flags)") from None
    finally:
        sys.stderr.write(captured.getvalue())


def enum_type(handler, enum_class):
    """megatron.training's argparse ``type`` for an enum-valued flag (``--exit-signal SIGTERM``), whose unknown
    member name is a ``KeyError`` argparse passes up as a traceback: argparse's usage error instead, naming the
    members (``usage_error_refused`` then makes it one line)."""

    @functools.wraps(handler)
    def member(name: str):
        try:
            return handler(name)
        except KeyError:
            raise argparse.ArgumentTypeError(f"{name!r} is not one of {', '.join(enum_class.__members__)}") from None

    return member


# megatron-core's own tokenizers (megatron/core/tokenizers/utils/build_tokenizer.py, MEGATRON_TOKENIZERS) and the
# files each reads: without them megatron fetches the files from the internet with wget on rank 0, a
# ModuleNotFoundError where wget is not installed and a hang where no network is
_TOKENIZER_FILES = {"GPT2BPETokenizer": ("vocab_file", "merge_file"), "BertWordPieceLowerCase": ("vocab_file",),
                    "BertWordPieceCase": ("vocab_file",)}


def check_tokenizer(args) -> None:
    """A megatron tokenizer without its vocabulary files (Megatron-LM's pretrain_gpt.py defaults to
    GPT2BPETokenizer) is one line naming the flags, not a download."""
    missing = [name for name in _TOKENIZER_FILES.get(args.tokenizer_type, ()) if not getattr(args, name, None)]
    if missing:
        needed = " and ".join(_flags()[name].option_strings[0] for name in missing)
        raise InputRefused(f"--tokenizer-type {args.tokenizer_type} needs {needed} (megatron would download "
                           "them): pass them, or another tokenizer (--tokenizer-type HuggingFaceTokenizer "
                           "--tokenizer-model DIR, or NullTokenizer --vocab-size N), or --model NAME")


def check_vocabulary(args, tokenizer) -> None:
    """The embedding's rows, where given (``--padded-vocab-size``; ``--model NAME`` gives the model's own), hold
    every token the tokenizer makes: megatron does not check it, and a larger id fails in the embedding."""
    rows = getattr(args, "padded_vocab_size", None)
    if rows is not None and tokenizer.vocab_size > rows:
        raise InputRefused(f"--padded-vocab-size {rows}: the tokenizer ({args.tokenizer_type}) has "
                           f"{tokenizer.vocab_size} entries, more than the embedding's {rows} rows: use the model's "
                           f"tokenizer (or a smaller --vocab-size), or pass --padded-vocab-size N of at least "
                           f"{tokenizer.vocab_size}")


# OptimizerParamScheduler's values -> the arguments megatron.training computes each from (get_optimizer_param_
# scheduler): what a failed check of the schedule names, with the values given
_SCHEDULE_SOURCES = {
    "lr_warmup_steps": ("lr_warmup_iters", "lr_warmup_samples", "lr_warmup_fraction"),
    "lr_decay_steps": ("lr_decay_iters", "lr_decay_samples", "train_iters", "train_samples"),
    "wsd_decay_steps": ("lr_wsd_decay_iters", "lr_wsd_decay_samples"),
    "max_lr": ("lr",), "min_lr": ("min_lr",), "init_lr": ("lr_warmup_init",),
    "start_wd": ("start_weight_decay", "weight_decay"), "end_wd": ("end_weight_decay", "weight_decay"),
}


def schedule_refusal(exc: BaseException, args) -> InputRefused | None:
    """The one line for a failed check of megatron-core's ``OptimizerParamScheduler``, which megatron.training
    builds from the arguments after the model (its asserts say nothing: ``lr_warmup_steps <
    lr_decay_steps`` where the warm-up does not end before the decay); None for anything else."""
    tb = _raising_frame(exc)
    if (not isinstance(exc, AssertionError) or tb is None
            or tb.tb_frame.f_globals.get("__name__") != "megatron.core.optimizer_param_scheduler"):
        return None
    test, _ = _failed_check(tb.tb_frame.f_code.co_filename, tb.tb_lineno)
    if test is None:
        return None
    values = [node.attr for node in ast.walk(test) if isinstance(node, ast.Attribute)]
    names = [name for value in values for name in _SCHEDULE_SOURCES.get(value, ()) if getattr(args, name, None)]
    given = ", ".join(as_given(name, args) for name in dict.fromkeys(names))
    reason = (f"the learning-rate schedule megatron builds from them needs {ast.unparse(test).replace('self.', '')}"
              f" (megatron-core's OptimizerParamScheduler)")
    return InputRefused(f"{given}: {reason}" if given else reason)


def data_prefixes(args) -> list[tuple[str, str]]:
    """(flag, prefix) for each corpus the run's indexed datasets read, in megatron's own reading of
    --data-path, --data-args-path, --{train,valid,test}-data-path and --per-split-data-args-path. None for
    --mock-data; a prefix that is itself a file or directory (an SFT jsonl, an object store URL) is another
    dataset's format and left to it."""
    from megatron.training.utils import get_blend_and_blend_per_split

    if getattr(args, "mock_data", False):
        return []
    blend, per_split = get_blend_and_blend_per_split(args)
    splits = [("--data-args-path" if args.data_args_path else "--data-path", blend)] if blend else []
    if per_split:
        flags = ("--per-split-data-args-path",) * 3 if args.per_split_data_args_path else _PER_SPLIT
        splits += [(flag, split) for flag, split in zip(flags, per_split) if split]
    found = [(flag, prefix) for flag, (prefixes, _) in splits for prefix in prefixes]
    return [(flag, prefix) for flag, prefix in dict.fromkeys(found) if "://" not in prefix
            and not os.path.exists(prefix)]


_checked: set[tuple] = set()  # corpora already decided (megatron builds iterators per virtual stage)


def check_data(args) -> None:
    """Every corpus of ``data_prefixes``: its .bin/.idx there, then ``check_corpus`` against the padded
    vocabulary (an ``args.check_token_ids`` of False, which no Megatron-LM flag sets, skips the scan). Decided on
    rank 0, which reads data on every layout, for every rank (``_decided_on_rank_0``): a refusal is an
    ``InputRefused`` on every rank."""
    prefixes = tuple(data_prefixes(args))
    if not prefixes or prefixes in _checked:
        return
    vocab = getattr(args, "padded_vocab_size", None)
    scan = vocab is not None and getattr(args, "check_token_ids", True)

    def decide() -> str:
        try:
            for flag, prefix in prefixes:
                check_files(prefix, flag)
            for _, prefix in dict.fromkeys(prefixes):
                check_corpus(prefix, vocab, scan)
        except (ValueError, OSError) as exc:  # a DataError, or a file that does not read
            return " ".join(str(exc).split())
        return ""

    message = _decided_on_rank_0(decide)
    _checked.add(prefixes)
    if message:
        raise InputRefused(message)


def _decided_on_rank_0(decide) -> str:
    """``decide()`` on rank 0 given to every rank (without a process group, this process's own). The other
    ranks wait for it in the broadcast, so the process group's timeout (--distributed-timeout-minutes) must
    cover rank 0's pass over the data. Should ``decide`` raise on rank 0, the others still hear (and refuse)."""
    if not torch.distributed.is_initialized():
        return decide()
    verdict = [None]
    try:
        if torch.distributed.get_rank() == 0:
            verdict[0] = decide()
    finally:
        torch.distributed.broadcast_object_list(verdict, src=0)
    return "checking the data failed on rank 0" if verdict[0] is None else verdict[0]

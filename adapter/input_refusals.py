"""Bad input to megatron.training ends in one line for the job and exit status 2 on every rank, as our own flow's
arguments do, not in a traceback from every rank (issue 50): for Megatron-LM's pretrain_gpt.py through
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
import functools
import linecache
import os

import torch

from adapter.corpus_check import check_corpus, check_files
from adapter.cuda_only_features import RefusedSetting

# What megatron raises for input it refuses; anything else (a TypeError, a KeyError) is a fault of code
CHECK_FAILURES = (AssertionError, ValueError, RuntimeError, NotImplementedError)
_PER_SPLIT = ("--train-data-path", "--valid-data-path", "--test-data-path")


class InputRefused(RefusedSetting):
    """Input megatron.training cannot train on (arguments, data), said in one line for the job."""


def refusal(exc: BaseException, args) -> InputRefused | None:
    """The one line for ``exc``, a check of megatron's own (``CHECK_FAILURES`` raised in a ``megatron.``
    module) that failed on ``args``: the arguments its check reads (and those that made the check apply),
    with their values, then megatron's message, or its condition where the ``assert`` has none. None for
    anything else, which keeps its traceback."""
    tb = _raising_frame(exc)
    if (isinstance(exc, RefusedSetting) or not isinstance(exc, CHECK_FAILURES) or tb is None
            or not tb.tb_frame.f_globals.get("__name__", "").startswith("megatron.")):
        return None
    test, guard = _failed_check(tb.tb_frame.f_code.co_filename, tb.tb_lineno)
    names = [name for name in _names(guard) if getattr(args, name, None)] + _names(test)
    reason = " ".join(str(exc).split())
    if not reason:
        reason = f"Megatron-LM's validate_args requires {_condition(test) if test else 'what an assertion says'}"
        reason += f" when {_condition(guard)}" if guard else ""
    given = ", ".join(_as_given(name, args) for name in dict.fromkeys(names))
    return InputRefused(f"{given}: {reason}" if given else reason)


def refused_call(call, to_refusal, args):
    """``call()``; where it fails one of megatron's checks (``CHECK_FAILURES``) that ``to_refusal(exc, args)``
    turns into an ``InputRefused``, that refusal instead; anything else keeps its traceback."""
    try:
        return call()
    except CHECK_FAILURES as exc:
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


def _names(test: ast.expr | None) -> list[str]:
    """The ``args.NAME`` a condition reads."""
    return [node.attr for node in ast.walk(test) if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name) and node.value.id == "args"] if test else []


def _condition(test: ast.expr) -> str:
    return ast.unparse(test).replace("args.", "")


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


def _as_given(name: str, args) -> str:
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
    on every rank, after the model is built."""
    if (args.eval_interval is None and not args.skip_train and not getattr(args, "full_validation", False)
            and not getattr(args, "perform_rl_step", False)):  # RL builds no datasets
        raise InputRefused("--eval-interval is not set: Megatron-LM's training needs it to size and schedule "
                           "validation (pass --eval-interval N; with --eval-iters 0 nothing is evaluated)")


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
    given = ", ".join(_as_given(name, args) for name in dict.fromkeys(names))
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
    vocabulary (the own flow's --no-check-token-ids, where given, skips the scan of the tokens). Decided on
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

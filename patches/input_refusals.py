"""Bad input to megatron.training, the registry entries (the mechanism: ``adapter/input_refusals.py``): a check
of Megatron-LM's ``validate_args`` that fails, a missing --eval-interval, a megatron tokenizer without its
vocabulary files, and a --data-path corpus that is
missing or holds ids outside the vocabulary each end in one ``InputRefused`` line for the job, which
``adapter.run`` prints from rank 0 with exit status 2 on every rank. megatron.training's code is unchanged;
its own message is the reason. On 0.16.1 (no megatron.training in the wheel) they stay pending without a
Megatron-LM checkout."""

from __future__ import annotations

import copy
import functools

from adapter import input_refusals

_T = "megatron.training."


def one_line_refusals(validate_args):
    """Outermost around ``validate_args`` (registered last): every rank fails the same check the same way,
    before any process group exists, so its exception becomes the refusal; an exception from elsewhere
    than megatron's checks keeps its traceback. Then the schedule and tokenizer checks megatron lacks."""

    @functools.wraps(validate_args)
    def validate(args, *rest, **kwargs):
        validated = input_refusals.refused_call(lambda: validate_args(args, *rest, **kwargs),
                                                input_refusals.refusal, args)
        input_refusals.check_schedule(args)
        input_refusals.check_tokenizer(args)
        return validated

    return validate


def vocabulary_checked(build_tokenizer):
    """megatron.training builds the tokenizer on every rank before any process group: one whose entries
    outnumber the embedding's given rows is one line there, not an index error in the first forward."""

    @functools.wraps(build_tokenizer)
    def build(args, *rest, **kwargs):
        tokenizer = build_tokenizer(args, *rest, **kwargs)
        input_refusals.check_vocabulary(args, tokenizer)
        return tokenizer

    return build


def corpora_checked(build_iterators):
    """Before megatron.training builds its datasets (on every rank, once per virtual stage): the corpora
    checked (``input_refusals.check_data``), where a missing prefix would otherwise fail in megatron's
    IndexedDataset on the data-reading ranks and leave the others waiting in its broadcast."""

    @functools.wraps(build_iterators)
    def build(*args, **kwargs):
        from megatron.training.global_vars import get_args

        input_refusals.check_data(get_args())
        return build_iterators(*args, **kwargs)

    return build


def schedule_refused(get_scheduler):
    """megatron.training builds the LR scheduler from the arguments after the model, outside validate_args:
    a schedule megatron-core's scheduler refuses (a warm-up as long as the decay) is one line, not a bare
    ``AssertionError`` on every rank."""

    @functools.wraps(get_scheduler)
    def build(*args, **kwargs):
        from megatron.training.global_vars import get_args

        given = copy.copy(get_args())  # as given: megatron fills --lr-decay-iters in before it builds
        return input_refusals.refused_call(lambda: get_scheduler(*args, **kwargs), input_refusals.schedule_refusal,
                                           given)

    return build


def register(registry, versions: str) -> None:
    registry.wrap(f"{_T}arguments:validate_args", one_line_refusals, versions=versions,
                  reason="a failed assert in validate_args is a bare traceback on every rank: one line, exit 2")
    registry.wrap(f"{_T}global_vars:build_tokenizer", vocabulary_checked, versions=versions,
                  reason="a tokenizer larger than --padded-vocab-size fails in the embedding: one line, exit 2")
    registry.wrap(f"{_T}training:build_train_valid_test_data_iterators", corpora_checked, versions=versions,
                  reason="a missing or out-of-vocabulary --data-path fails mid-build on some ranks: one line, exit 2")
    registry.wrap(f"{_T}training:get_optimizer_param_scheduler", schedule_refused, versions=versions,
                  reason="a warm-up as long as the decay fails a bare assert in the LR scheduler: one line, exit 2")

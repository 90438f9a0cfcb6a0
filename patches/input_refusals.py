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

from packaging.version import Version

from adapter import input_refusals, moe_layer_pattern, moe_refusals
from adapter.registry import installed_megatron_core_version

_T = "megatron.training."


def one_line_refusals(validate_args):
    """Outermost around ``validate_args`` (registered last): every rank fails the same check the same way,
    before any process group exists, so its exception becomes the refusal; an exception from elsewhere
    than megatron's checks keeps its traceback. Before it the sizes it divides by; after it the checks
    megatron lacks (schedule, tokenizer, MoE settings: adapter/moe_refusals.py, the offload share, manual GC)."""

    @functools.wraps(validate_args)
    def validate(args, *rest, **kwargs):
        input_refusals.check_sizes(args)
        moe_refusals.check_before(args)
        validated = input_refusals.refused_call(lambda: validate_args(args, *rest, **kwargs),
                                                input_refusals.refusal, args)
        input_refusals.check_schedule(args)
        input_refusals.check_tokenizer(args)
        input_refusals.check_moe_routing(args)
        moe_refusals.check(args)
        input_refusals.check_offload_fraction(args)
        input_refusals.check_manual_gc(args)
        return validated

    return validate


def one_usage_error(parse_args):
    """argparse's usage error in megatron's parser: one line from rank 0 (``usage_error_refused``)."""

    @functools.wraps(parse_args)
    def parse(*args, **kwargs):
        return input_refusals.usage_error_refused(lambda: parse_args(*args, **kwargs))

    return parse


def enum_names_refused(get_enum_kwargs):
    """An unknown name for an enum-valued flag: argparse's usage error, not a KeyError (``enum_type``)."""

    @functools.wraps(get_enum_kwargs)
    def enum_kwargs(self, config_type):
        kwargs = get_enum_kwargs(self, config_type)
        return {**kwargs, "type": input_refusals.enum_type(kwargs["type"], config_type)}

    return enum_kwargs


def config_refused(config_from_args):
    """megatron.training builds megatron-core's TransformerConfig from the arguments after ``validate_args``
    (gpt_config_from_args, the model builders), on every rank: a check of the config that fails (heads not
    divisible by TP, an uneven pipeline split that does not add up) is one line, not a traceback per rank."""

    @functools.wraps(config_from_args)
    def build(args, *rest, **kwargs):
        return input_refusals.refused_call(lambda: config_from_args(args, *rest, **kwargs),
                                           input_refusals.config_refusal, args)

    return build


def tokenizer_refused(build_tokenizer):
    """megatron.training builds the tokenizer as it sets its globals, after ``validate_args``: a missing or
    unreadable --tokenizer-model fails a check of megatron-core's tokenizers on every rank."""

    @functools.wraps(build_tokenizer)
    def build(args, *rest, **kwargs):
        return input_refusals.refused_call(lambda: build_tokenizer(args, *rest, **kwargs),
                                           input_refusals.tokenizer_refusal, args)

    return build


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


def checkpoint_refused(load_checkpoint):
    """megatron.training's ``load_checkpoint`` checks what it reads against the run on every rank, after the
    model is built: a check that fails (an optimizer state sharded for another (TP, PP) or another expert
    split), a tensor saved in another shape or not at all (megatron-core's loader), or a checkpoint of
    another format than the run's (which fails anywhere in the reading) is one line, not a traceback per rank."""

    @functools.wraps(load_checkpoint)
    def load(*args, **kwargs):
        from megatron.core.dist_checkpointing.core import CheckpointingException
        from megatron.training.global_vars import get_args
        from torch.distributed.checkpoint.api import CheckpointException

        failures = (*input_refusals.CHECK_FAILURES, CheckpointingException, CheckpointException, KeyError,
                    AttributeError)
        return input_refusals.refused_call(lambda: load_checkpoint(*args, **kwargs),
                                           input_refusals.checkpoint_refusal, get_args(), failures)

    return load


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
    registry.wrap(f"{_T}arguments:parse_args", one_usage_error, versions=versions,
                  reason="argparse's usage error prints megatron's whole usage from every rank: one line, exit 2")
    registry.wrap(f"{_T}argument_utils:ArgumentGroupFactory._get_enum_kwargs", enum_names_refused,
                  versions=versions,
                  reason="an unknown enum name (--exit-signal SIGFOO): a KeyError argparse passes on; its usage error")
    config_module = "argument_utils" if Version(installed_megatron_core_version()) >= Version("0.18") else "arguments"
    registry.wrap(f"{_T}{config_module}:core_transformer_config_from_args", config_refused, versions=versions,
                  reason="a failed check of TransformerConfig is a traceback on every rank: one line, exit 2 (0.18 "
                         "moved it to argument_utils)")
    registry.wrap(f"{_T}global_vars:_build_tokenizer", tokenizer_refused, versions=versions,
                  reason="a missing or unreadable --tokenizer-model fails megatron's tokenizer on every rank: one line")
    registry.wrap(f"{_T}arguments:validate_args", one_line_refusals, versions=versions,
                  reason="a failed assert in validate_args is a bare traceback on every rank: one line, exit 2")
    registry.wrap(f"{_T}global_vars:build_tokenizer", vocabulary_checked, versions=versions,
                  reason="a tokenizer larger than --padded-vocab-size fails in the embedding: one line, exit 2")
    registry.wrap(f"{_T}training:build_train_valid_test_data_iterators", corpora_checked, versions=versions,
                  reason="a missing or out-of-vocabulary --data-path fails mid-build on some ranks: one line, exit 2")
    registry.wrap(f"{_T}training:get_optimizer_param_scheduler", schedule_refused, versions=versions,
                  reason="a warm-up as long as the decay fails a bare assert in the LR scheduler: one line, exit 2")
    registry.wrap(f"{_T}checkpointing:load_checkpoint", checkpoint_refused, versions=versions,
                  reason="a check of what load_checkpoint read fails with a traceback on every rank: one line, exit 2")
    registry.replace(f"{_T}arguments:_eval_pattern", moe_layer_pattern.read, versions=versions, optional=True,
                     reason="--moe-layer-freq's pattern is eval'd: [1]*10**9 builds a billion entries; read, bounded")

"""Where megatron.training's ``pretrain`` and megatron-core's batch helpers differ between the releases the flow
runs on (megatron-core 0.16.1 to 0.19.2): the one place the flow branches on the installed release, so that
``flow.pretrain`` and ``flow.gpt`` read as Megatron-LM's ``pretrain_gpt.py`` of one release.

- ``pretrain``: from 0.19 it takes the config container with the GPT model's config and builds the model itself;
  0.18 takes the container and a model provider (Megatron-LM's gpt_builders.py, which the wheel lacks:
  ``flow.gpt_model``); 0.16 and 0.17 take the provider and parse ``sys.argv`` themselves.
- a micro-batch's broadcast over tensor-parallel ranks: megatron-core's ``get_batch_on_this_tp_rank`` from 0.18
  (its packed-sequence keyword renamed in 0.19); megatron.training's, which reads the iterator itself, before.
- its split over context-parallel ranks: ``get_batch_on_this_cp_rank`` takes ``is_hybrid_cp`` from 0.18.
"""

from __future__ import annotations

from megatron.core import parallel_state
from megatron.core import utils as core_utils
from megatron.core.enums import ModelType
from megatron.core.package_info import __version__
from packaging.version import Version

# (major, minor) of the installed megatron-core
RELEASE = Version(__version__).release[:2]
# Megatron-LM's pretrain_gpt.py gives the same default
ARGS_DEFAULTS = {"tokenizer_type": "GPT2BPETokenizer"}


def pretrain_gpt(datasets_provider, forward_step, model_inputs=None) -> None:
    """megatron.training's ``pretrain`` on ``sys.argv`` as Megatron-LM's ``pretrain_gpt.py`` of the installed
    release calls it, with the GPT model Megatron-LM's script builds at that release; ``model_inputs(args)``,
    (the config container, a model provider) for a model megatron's GPT builder does not build (0.18+)."""
    from megatron.training import pretrain

    from flow import gpt_model

    model_type = ModelType.encoder_or_decoder
    if RELEASE < (0, 18):
        pretrain(datasets_provider, gpt_model.model_provider, model_type, forward_step, args_defaults=ARGS_DEFAULTS)
        return
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    args = parse_and_validate_args(args_defaults=ARGS_DEFAULTS)
    if model_inputs is not None:
        container, provider = model_inputs(args)
    elif RELEASE < (0, 19):
        container, provider = pretrain_cfg_container_from_args(args), gpt_model.model_provider
    else:
        from megatron.training.argument_utils import gpt_config_from_args

        container, provider = pretrain_cfg_container_from_args(args, gpt_config_from_args(args)), None
    if RELEASE < (0, 19):
        pretrain(container, datasets_provider, provider, model_type, forward_step)
    else:
        pretrain(container, datasets_provider, model_type, forward_step, model_provider=provider)


def batch_on_this_tp_rank(data_iterator, args, read) -> dict:
    """The next micro-batch on every tensor-parallel rank: rank 0 reads it (``read(data_iterator)``, on this
    device), megatron broadcasts it to the others. The last pipeline stage of a model with MTP layers (megatron
    places them there) gets the tokens and positions too, which its MTP layers embed."""
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    mtp_here = bool(getattr(args, "mtp_num_layers", None)) and parallel_state.is_pipeline_last_stage()
    if RELEASE < (0, 18):
        from megatron.training.utils import get_batch_on_this_tp_rank

        return get_batch_on_this_tp_rank(data_iterator, mtp_on_this_rank=mtp_here)
    packed = {"has_cu_seqlens" if RELEASE >= (0, 19) else "is_sft": False}
    return core_utils.get_batch_on_this_tp_rank(
        read(data_iterator) if tp_rank == 0 else {}, **packed, is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=parallel_state.get_tensor_model_parallel_src_rank(),
        broadcast_group=parallel_state.get_tensor_model_parallel_group(), cp_size=args.context_parallel_size,
        tp_rank=tp_rank, micro_batch_size=args.micro_batch_size, seq_length=args.seq_length,
        mtp_on_this_rank=mtp_here, pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=parallel_state.is_pipeline_first_stage(),
        is_pipeline_last_stage=parallel_state.is_pipeline_last_stage())


def batch_on_this_cp_rank(batch: dict) -> dict:
    """This context-parallel rank's part of ``batch`` (all of it at context parallel size 1)."""
    hybrid = {"is_hybrid_cp": False} if RELEASE >= (0, 18) else {}
    return core_utils.get_batch_on_this_cp_rank(batch, **hybrid, cp_group=parallel_state.get_context_parallel_group())

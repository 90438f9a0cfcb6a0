"""The hybrid models (Qwen3.5, Qwen3-Next: Gated DeltaNet layers) in megatron.training's own ``pretrain``.

megatron.training's GPT model config builds GPT stacks only, and its hybrid one takes Transformer Engine's
specs. So ``--model NAME`` of a hybrid model stands for Megatron-LM's flags of it (``flow.model_flags``: its
``--hybrid-layer-pattern`` and Gated DeltaNet sizes among them, so megatron.training counts, logs and
checkpoints a hybrid run as its own), and ``pretrain`` gets a ``model_provider`` that builds it with the
project's builder (``models.provider.build_model``: megatron-core's HybridModel from local specs) on
megatron.training's own TransformerConfig of those arguments, so every flag keeps megatron's meaning.
"""

from __future__ import annotations

import argparse
import warnings

from megatron.training import get_args
from megatron.training.arguments import core_transformer_config_from_args

import models
from adapter.input_refusals import InputRefused
from models.config import HYBRID_FIELDS, ModelConfig, ModelConfigError
from models.hybrid import layer_pattern
from models.provider import build_model, config_from_args

# pretrain_cfg_container_from_args's advice where it gets no model config: a model_provider is what we give
_NO_MODEL_CONFIG = r"\s*It is recommended to use a ModelConfig"


def named(name: str | None) -> bool:
    """Whether ``--model name`` is a hybrid model (an unknown name was refused when argv was expanded)."""
    return name in models.names() and models.get(name).layer_types is not None


def pretrain_inputs(args: argparse.Namespace, name: str):
    """(the config container, the ``model_provider``) that ``pretrain`` trains hybrid model ``name`` with on
    megatron.training's parsed ``args``."""
    from megatron.training.argument_utils import pretrain_cfg_container_from_args  # 0.18+, as the config container

    model = _as_given(args, name)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_MODEL_CONFIG)
        container = pretrain_cfg_container_from_args(args)
    return container, model_provider(model)


def _as_given(args: argparse.Namespace, name: str) -> ModelConfig:
    """``name``'s config with the architecture flags the command line gave over it (argparse kept the last
    value), which the builder reads: one line where they do not fit together, or the parallel layout splits
    what the model cannot (a Gated DeltaNet head over tensor x context parallel ranks). megatron's layer count
    is its pattern's, two per model layer: the pattern stands for the model's layers."""
    given = {**vars(args), "model": name, "num_layers": None}
    try:
        model = config_from_args(argparse.Namespace(**given)).replace(
            **{field: getattr(args, field) for field in HYBRID_FIELDS})
        model.check_layout(args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                           args.virtual_pipeline_model_parallel_size, args.expert_model_parallel_size,
                           args.expert_tensor_parallel_size, args.context_parallel_size)
    except ModelConfigError as exc:
        raise InputRefused(f"--model {name}: {exc}") from None
    if args.hybrid_layer_pattern != layer_pattern(model):
        raise InputRefused(f"--hybrid-layer-pattern {args.hybrid_layer_pattern}: {name}'s layers are "
                           f"{layer_pattern(model)}; leave the flag out")
    return model


def model_provider(model: ModelConfig):
    """``model_provider`` as megatron.training's ``get_model`` calls it, building ``model``."""

    def provide(pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None, config=None,
                pg_collection=None):
        """This rank's chunk; ``pg_collection`` is megatron's initialised groups, which the builder reads itself."""
        return build_model(model, config or core_transformer_config_from_args(get_args()), vp_stage=vp_stage,
                           pre_process=pre_process, post_process=post_process)

    return provide

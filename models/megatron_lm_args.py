"""Megatron-LM's own command-line flags for a named model: what ``--model NAME`` stands for.

Megatron-LM's ``pretrain_gpt.py`` knows a model only by its architecture flags (``--num-layers``,
``--swiglu``, ``--group-query-attention``, ...). ``flags(config)`` writes them for a ``ModelConfig``, so a
named model trains through megatron.training's own parser and builder with the weights our conversion and
checkpoints expect; the flags a user adds after them override them (argparse keeps the last value):

    torchrun ... -m adapter.run /path/to/Megatron-LM/pretrain_gpt.py $(python -m models.megatron_lm_args qwen3-8b) ...

The embedding's rows are the named model's (``--padded-vocab-size``, so a Hugging Face checkpoint converted by
``scripts/convert_checkpoint.py`` loads at any TP, whatever the tokenizer; megatron would otherwise pad the
tokenizer's vocabulary to a multiple of 128 x TP, past the HF rows at TP > 1 for Qwen's 151936), and the
tokenizer, unless the command line names its own, is NullTokenizer over those rows (Megatron-LM's default,
GPT2BPETokenizer, needs GPT-2's vocabulary files). Left to the rest of the command line: dropout and every
training setting; ``--seq-length`` is the model's usual one, which a later ``--seq-length`` replaces. A model
Megatron-LM's flags cannot describe is refused in one line naming the field: hybrid models (Gated DeltaNet layers:
Megatron-LM's pretrain_hybrid.py, with flags of its own) and YaRN settings that ``MLATransformerConfig`` only
takes at their defaults (no flag sets them).
"""

from __future__ import annotations

import shlex
import sys

from packaging.version import Version

from adapter.registry import installed_megatron_core_version

from .config import _FIELD_DEFAULTS, ModelConfig, ModelConfigError

# ModelConfig fields whose Megatron-LM flag (``--`` and the field's name, dashed, unless _RENAMED) takes the
# value as is: the structural ones always given, the others where they differ from ModelConfig's default, which
# is Megatron-LM's
_STRUCTURE = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "max_position_embeddings",
              "seq_length", "normalization", "position_embedding")
_VALUED = ("kv_channels", "norm_epsilon", "rotary_base", "rotary_percent")
_MOE_VALUED = ("moe_ffn_hidden_size", "moe_router_topk", "moe_shared_expert_intermediate_size",
               "moe_router_score_function", "moe_router_topk_scaling_factor", "moe_aux_loss_coeff",
               "moe_router_num_groups", "moe_router_group_topk")
_MLA_VALUED = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
               "rotary_scaling_factor", "mscale", "mscale_all_dim")
# ModelConfig's booleans whose Megatron-LM switch turns them on
_SWITCHES = ("add_qkv_bias", "qk_layernorm", "attention_output_gate", "zero_centered_norm", "moe_shared_expert_gate",
             "moe_router_pre_softmax", "moe_router_enable_expert_bias", "multi_latent_attention")
_RENAMED = {"position_embedding": "--position-embedding-type", "zero_centered_norm": "--apply-layernorm-1p"}
# MLATransformerConfig's YaRN fields that no Megatron-LM flag sets, at the value Megatron-LM builds them with
_UNFLAGGED = {"original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0}
# the first release with --yarn-original-max-position-embeddings / --yarn-beta-fast / --yarn-beta-slow, which the
# adapter sets on an MLA model's config (patches/latent_attention.py)
_MLA_YARN_SINCE = "0.19"
# the first release whose NullTokenizer counts --vocab-size entries, its end-of-document id the last of them
# (megatron-core 0.16 / 0.17 add one entry for it)
_NULL_VOCAB_SINCE = "0.18"


def flags(config: ModelConfig) -> list[str]:
    """Megatron-LM's flags that build ``config``'s architecture and vocabulary (module docstring)."""
    _refuse_unflagged(config)
    return described(config)


def described(config: ModelConfig) -> list[str]:
    """``flags`` of what Megatron-LM's flags can say of ``config``, not refusing the rest (a hybrid model's layer
    types, MLA's YaRN settings): for a reader that takes those from the config itself (``flow.memory_plan``)."""
    words = [*vocabulary(config), *_valued(config, _STRUCTURE, always=True), *_valued(config, _VALUED)]
    if config.num_query_groups != config.num_attention_heads:
        words += ["--group-query-attention", "--num-query-groups", str(config.num_query_groups)]
    if config.activation == "swiglu":
        words.append("--swiglu")
    if not config.add_bias_linear:
        words.append("--disable-bias-linear")
    if not config.tie_embeddings:
        words.append("--untie-embeddings-and-output-weights")
    if config.num_experts is not None:
        words += ["--num-experts", str(config.num_experts), *_valued(config, _MOE_VALUED),
                  "--moe-layer-freq", _layer_freq(config.moe_layer_freq)]
    if config.multi_latent_attention:
        words += _valued(config, _MLA_VALUED)
    if config.multi_latent_attention and Version(installed_megatron_core_version()) >= Version(_MLA_YARN_SINCE):
        words += [word for field, default in _UNFLAGGED.items() if getattr(config, field) != default
                  for word in (f"--yarn-{field.replace('_', '-')}", _text(getattr(config, field)))]
    if config.mtp_num_layers is not None:
        words += ["--mtp-num-layers", str(config.mtp_num_layers)]
    return words + [_flag(field) for field in _SWITCHES if getattr(config, field)]


def vocabulary(config: ModelConfig) -> list[str]:
    """The named model's embedding rows, and NullTokenizer over them for a command line that names no tokenizer
    of its own (its flags come later and win)."""
    return null_vocabulary(config.vocab_size)


def null_vocabulary(rows: int) -> list[str]:
    """``rows`` embedding rows and NullTokenizer over them, on the installed release."""
    entries = rows
    if Version(installed_megatron_core_version()) < Version(_NULL_VOCAB_SINCE):
        entries -= 1  # the release's NullTokenizer adds its end-of-document token
    return ["--padded-vocab-size", str(rows), "--tokenizer-type", "NullTokenizer", "--vocab-size", str(entries)]


def _valued(config: ModelConfig, fields: tuple[str, ...], always: bool = False) -> list[str]:
    """``flag value`` for each of ``fields`` set on ``config`` (not None), where ``always`` or not the default."""
    words = []
    for field in fields:
        value = getattr(config, field)
        if value is not None and (always or value != _FIELD_DEFAULTS[field]):
            words += [_flag(field), _text(value)]
    return words


def _flag(field: str) -> str:
    return _RENAMED.get(field, "--" + field.replace("_", "-"))


def _text(value) -> str:
    """A whole float as an int: Megatron-LM's --rotary-base is an int flag (Qwen's 1000000.0)."""
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    return str(value)


def _layer_freq(freq: int | tuple[int, ...]) -> str:
    """--moe-layer-freq as Megatron-LM reads it: an int, or a list expression of digits, brackets, ``*`` and
    ``+`` only (no spaces), written as runs: ``[0]*3+[1]*58``."""
    if isinstance(freq, int):
        return str(freq)
    runs = [[freq[0], 0]]
    for value in freq:
        if value != runs[-1][0]:
            runs.append([value, 0])
        runs[-1][1] += 1
    return "+".join(f"[{value}]*{count}" for value, count in runs)


def _refuse_unflagged(config: ModelConfig) -> None:
    """One line for what Megatron-LM's flags cannot say (module docstring)."""
    if config.layer_types is not None:
        raise ModelConfigError("a hybrid model (Gated DeltaNet layers, layer_types): Megatron-LM's pretrain_gpt.py "
                               "builds GPT stacks only; train it with scripts/pretrain_gpt.py --model NAME")
    if config.multi_latent_attention and Version(installed_megatron_core_version()) < Version(_MLA_YARN_SINCE):
        for field, value in _UNFLAGGED.items():
            if getattr(config, field) != value:
                raise ModelConfigError(
                    f"{field}={getattr(config, field)!r}: Megatron-LM has no flag for it before megatron-core "
                    f"{_MLA_YARN_SINCE} and builds MLATransformerConfig with {value!r}; install megatron-core "
                    f"{_MLA_YARN_SINCE} or later (Python 3.12), whose --yarn-* flags set it")


def main(argv: list[str] | None = None) -> int:
    """``python -m models.megatron_lm_args NAME``: the flags, shell-quoted on one line."""
    from . import get, names

    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0].startswith("-"):
        print(f"usage: python -m models.megatron_lm_args NAME (one of {', '.join(names())})", file=sys.stderr)
        return 2
    try:
        print(shlex.join(flags(get(argv[0]))))
    except ModelConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Megatron-LM's command-line arguments, the subset this flow supports, with Megatron-LM's names and
meanings, validated before anything is built.

Architecture arguments default to None: ``--model NAME`` (``models.names()``) supplies them and any given
one overrides it (``models.provider.config_from_args``). An argument Megatron-LM has and this flow does not
is refused in one line naming ``python -m adapter.run``, where Megatron-LM's own pretrain_gpt.py takes it
(``megatron_lm_flags``), never silently ignored; one no parser knows is argparse's "unrecognized arguments";
a combination that cannot run is one ``ArgumentError`` naming the values and the fix. Optimizer and
fine-grained activation offloading have their flags and checks in ``offloading``.
"""

from __future__ import annotations

import argparse
import ast
import os
import signal
import sys
from typing import NoReturn

import models
from adapter.corpus_check import DataError, check_files
from adapter.parallel import ModelShape, ParallelConfigError, PipelineSplit, check_sizes
from adapter.kernels import context_parallel
from adapter.training import offloading
from adapter import checkpoint_dir


class ArgumentError(ValueError):
    """Arguments that cannot run together: says which and what to change."""


def _model(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model")
    g.add_argument("--model", help="a named model config (models.names()); other architecture arguments "
                                   "override its values")
    for name, kind in (("num-layers", int), ("hidden-size", int), ("ffn-hidden-size", int),
                       ("num-attention-heads", int), ("num-query-groups", int), ("max-position-embeddings", int),
                       ("rotary-base", float), ("norm-epsilon", float), ("vocab-size", int)):
        g.add_argument(f"--{name}", type=kind)
    g.add_argument("--kv-channels", type=int,
                   help="each attention head's size (default: --hidden-size / --num-attention-heads; Qwen3's "
                        "is 128 whatever that is)")
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--position-embedding-type", choices=["rope", "learned_absolute"])
    g.add_argument("--use-rotary-position-embeddings", action="store_true",
                   help="Megatron-LM's older spelling of --position-embedding-type rope")
    g.add_argument("--normalization", choices=["RMSNorm", "LayerNorm"])
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--add-qkv-bias", action="store_true")
    g.add_argument("--qk-layernorm", action="store_true")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pads the tokenizer's vocabulary (not a named model's, which is padded already)")
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--transformer-impl", choices=["local", "transformer_engine"], default="local",
                   help="the adapter's layer spec (its kernel provider picks TE, torch_npu or torch kernels); "
                        "transformer_engine, Megatron-LM's default spelling, is the same spec here")
    g.add_argument("--use-flash-attn", action="store_true",
                   help="accepted for Megatron-LM scripts: the kernel provider's core attention is always the "
                        "fused one where the device has it")
    g.add_argument("--no-masked-softmax-fusion", action="store_false", dest="masked_softmax_fusion")
    g.add_argument("--no-bias-swiglu-fusion", action="store_false", dest="bias_swiglu_fusion")
    g.add_argument("--no-rope-fusion", action="store_false", dest="apply_rope_fusion")
    on_cuda = _on_cuda()
    g.add_argument("--cross-entropy-loss-fusion", action="store_true", default=on_cuda,
                   help="the kernel provider's fused cross entropy (default on CUDA, where it saves a host sync "
                        "and a pass over the logits)")
    g.add_argument("--no-cross-entropy-loss-fusion", action="store_false", dest="cross_entropy_loss_fusion")
    _latent_attention(g)
    g.add_argument("--mtp-num-layers", type=int,
                   help="multi-token prediction layers after the decoder (megatron's MTP block; DeepSeek-V3: 1)")
    g.add_argument("--mtp-loss-scaling-factor", type=float, default=0.1,
                   help="the weight of the MTP layers' mean loss beside the language-model loss")
    g.add_argument("--no-gradient-accumulation-fusion", action="store_false", dest="gradient_accumulation_fusion",
                   default=on_cuda, help="weight gradients accumulate in a bf16 .grad first (the fusion, "
                                         "default on CUDA, writes them into the float32 main_grad directly)")


def _latent_attention(g) -> None:
    """Megatron-LM's multi-latent attention flags (MLATransformerConfig's fields of the same names); unset,
    a named model's values, else Megatron-LM's defaults (``models.config.ModelConfig``'s)."""
    g.add_argument("--multi-latent-attention", action="store_true",
                   help="DeepSeek's multi-latent attention (keys and values through a shared low-rank latent)")
    for name, meaning in (("q-lora-rank", "the queries' low rank (default: none, one projection)"),
                          ("kv-lora-rank", "the key/value latent's rank (default 32)"),
                          ("qk-head-dim", "each query/key head's dimensions without RoPE (default 128)"),
                          ("qk-pos-emb-head-dim", "each query/key head's RoPE dimensions (default 64)"),
                          ("v-head-dim", "each value head's size (default 128)")):
        g.add_argument(f"--{name}", type=int, help=meaning)
    for name, meaning in (("rotary-scaling-factor", "MLA's YaRN RoPE scaling factor (default 1: plain RoPE)"),
                          ("mscale", "MLA's YaRN mscale (default 1)"),
                          ("mscale-all-dim", "MLA's YaRN mscale_all_dim (default 0)")):
        g.add_argument(f"--{name}", type=float, help=meaning)


def _on_cuda() -> bool:
    """Whether this process trains on CUDA: the fusions that default on there (as in Megatron-LM) need it."""
    import adapter

    return adapter.current_backend().name == "cuda"


# the longest --moe-layer-freq pattern accepted: far more layers than any model has, far less memory than
# a pattern like "[1]*10**12" would take
_MAX_PATTERN = 100_000


def moe_freq_type(text: str) -> int | list[int]:
    """``--moe-layer-freq``: an int N (every N-th layer is a MoE layer, from layer 0), or a Python list
    expression of 0s (dense) and 1s (MoE), one per layer, such as ``"([0]+[1]*3)*2"``. Megatron-LM
    evaluates the expression after checking its characters; here only integer literals, lists of them,
    ``+`` between lists and ``*`` between a list and an int are evaluated, and nothing else runs."""
    if "[" not in text:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is neither an int nor a list pattern") from None
    try:
        pattern = _pattern(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a pattern of lists of ints, + and *: {exc}") from None
    if not isinstance(pattern, list):
        raise argparse.ArgumentTypeError(f"{text!r} is an int, not a list pattern")
    return pattern


def _pattern(node: ast.AST) -> int | list[int]:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.List):
        items = [_pattern(item) for item in node.elts]
        if any(isinstance(item, list) for item in items):
            raise ValueError("lists inside lists")
        return items
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _pattern(node.left), _pattern(node.right)
        if isinstance(node.op, ast.Add) and isinstance(left, list) and isinstance(right, list):
            return _bounded(left + right)
        if isinstance(node.op, ast.Mult) and isinstance(left, list) != isinstance(right, list):
            items, times = (left, right) if isinstance(left, list) else (right, left)
            if len(items) * max(times, 0) > _MAX_PATTERN:
                raise ValueError(f"more than {_MAX_PATTERN} entries")
            return items * times
        raise ValueError("+ joins two lists and * repeats a list an int number of times")
    raise ValueError(f"{ast.unparse(node)!r} is not allowed")


def _bounded(items: list) -> list:
    if len(items) > _MAX_PATTERN:
        raise ValueError(f"more than {_MAX_PATTERN} entries")
    return items


def add_moe_model_arguments(g) -> None:
    """Megatron-LM's MoE arguments that define the weights and the routing (ModelConfig fields). They
    default to None (switches to False) so that a named model supplies them; unset on a model without
    one, they take Megatron-LM's defaults (ModelConfig's)."""
    g.add_argument("--num-experts", type=int, help="routed experts per MoE layer; 0 or none: a dense model")
    g.add_argument("--moe-ffn-hidden-size", type=int, help="each routed expert's FFN size (default: --ffn-hidden-size)")
    g.add_argument("--moe-router-topk", type=int, help="experts per token (default 2)")
    g.add_argument("--moe-layer-freq", type=moe_freq_type,
                   help="N: every N-th layer is MoE (default 1), or a pattern of 0/1 per layer, e.g. '([0]+[1]*3)*2'")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int,
                   help="FFN size of the shared experts together (default: none)")
    g.add_argument("--moe-shared-expert-gate", action="store_true")
    g.add_argument("--moe-router-score-function", choices=["softmax", "sigmoid"], help="default softmax")
    g.add_argument("--moe-router-pre-softmax", action="store_true")
    g.add_argument("--moe-router-topk-scaling-factor", type=float)
    g.add_argument("--moe-router-enable-expert-bias", action="store_true")


def _moe(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("mixture of experts")
    add_moe_model_arguments(g)
    g.add_argument("--expert-model-parallel-size", type=int, default=1)
    g.add_argument("--expert-tensor-parallel-size", type=int, help="default: --tensor-model-parallel-size")
    g.add_argument("--moe-grouped-gemm", action="store_true")
    g.add_argument("--moe-token-dispatcher-type", choices=["allgather", "alltoall"], default="allgather")
    g.add_argument("--moe-router-load-balancing-type", nargs="+", default="aux_loss",
                   choices=["aux_loss", "seq_aux_loss", "global_aux_loss", "none"])
    g.add_argument("--moe-aux-loss-coeff", type=float, nargs="+",
                   help="one per --moe-router-load-balancing-type; default: the named model's published "
                        "coefficient (qwen3-30b-a3b: 1e-3), else 0 (Megatron-LM's default is always 0, which "
                        "would train a published MoE model without its load balancing)")
    g.add_argument("--moe-z-loss-coeff", type=float)
    g.add_argument("--moe-shared-expert-overlap", action="store_true")
    g.add_argument("--moe-permute-fusion", action="store_true", default=_on_cuda(),
                   help="the kernel provider's token permutation (default on CUDA: megatron's unfused one "
                        "masked_selects tokens and probs, two host syncs per MoE layer; the fused one has none)")
    g.add_argument("--no-moe-permute-fusion", action="store_false", dest="moe_permute_fusion")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3)
    g.add_argument("--moe-expert-capacity-factor", type=float, help="default: none (no token dropped)")
    g.add_argument("--moe-pad-expert-input-to-capacity", action="store_true")
    g.add_argument("--moe-token-drop-policy", choices=["probs", "position"], default="probs")
    g.add_argument("--moe-router-dtype", choices=["fp32", "fp64"])
    g.add_argument("--moe-per-layer-logging", action="store_true")
    g.add_argument("--moe-router-num-groups", type=int,
                   help="group-limited routing: the experts fall into this many equal groups (DeepSeek-V3: 8)")
    g.add_argument("--moe-router-group-topk", type=int, help="the groups each token's experts are drawn from")


# Megatron-LM's --cp-comm-type values; the adapter's CP attention runs the first two
CP_COMM_TYPES = ("p2p", "a2a", "allgather", "a2a+p2p")
SUPPORTED_CP_COMM_TYPES = ("p2p", "a2a")


def _parallel(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int)
    g.add_argument("--virtual-pipeline-model-parallel-size", type=int)
    g.add_argument("--decoder-first-pipeline-num-layers", type=int,
                   help="an uneven split: the first pipeline stage's layers (the others share the rest evenly)")
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, help="an uneven split: the last stage's layers")
    g.add_argument("--account-for-embedding-in-pipeline-split", action="store_true",
                   help="the first stage holds one layer fewer, the embedding counted as one")
    g.add_argument("--account-for-loss-in-pipeline-split", action="store_true",
                   help="the last stage holds one layer fewer, the output layer and loss counted as one")
    g.add_argument("--context-parallel-size", type=int, default=1)
    g.add_argument("--cp-comm-type", nargs="+", choices=CP_COMM_TYPES, default=["p2p"],
                   help="how the CP ranks exchange attention work: p2p (ring attention) or a2a (Ulysses); one "
                        "type, or one per layer (all the same here)")
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--overlap-param-gather", action="store_true")
    g.add_argument("--ddp-bucket-size", type=int)
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo", "hccl"],
                   help="checked against the adapter's backend (which picks NCCL, HCCL or gloo by itself)")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10)  # fractions too: 0.5 is 30 s
    _sharded_data_parallel(g)


def _sharded_data_parallel(g) -> None:
    """Megatron-LM's sharded data parallelism: Megatron-FSDP (megatron's FullyShardedDataParallel) and torch
    FSDP2 (megatron's TorchFullyShardedDataParallel), with Megatron-LM's companion flags and defaults."""
    g.add_argument("--use-megatron-fsdp", action="store_true",
                   help="Megatron-FSDP in place of DDP (with the distributed optimizer and --ckpt-format fsdp_dtensor)")
    g.add_argument("--data-parallel-sharding-strategy", default="optim_grads_params",
                   choices=["no_shard", "optim", "optim_grads", "optim_grads_params"],
                   help="what Megatron-FSDP shards over the data-parallel ranks (default: all of them)")
    g.add_argument("--use-torch-fsdp2", action="store_true",
                   help="torch FSDP2 (fully_shard over the data-parallel group) in place of DDP; torch_dist saves")
    g.add_argument("--torch-fsdp2-no-reshard-after-forward", action="store_false",
                   dest="torch_fsdp2_reshard_after_forward",
                   help="FSDP2 keeps the gathered parameters from forward to backward (ZeRO-2)")


def _training(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--global-batch-size", type=int)
    g.add_argument("--seq-length", type=int)
    g.add_argument("--train-iters", type=int)
    g.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    g.add_argument("--lr", type=float)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine", "inverse-square-root"],
                   default="linear")
    g.add_argument("--lr-decay-iters", type=int)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-fraction", type=float)
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--sgd-momentum", type=float, default=0.9)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--loss-scale", type=float, help="a static loss scale (fp16); default: dynamic")
    g.add_argument("--initial-loss-scale", type=float, default=2.0**32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=int, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)
    g.add_argument("--recompute-granularity", choices=["full", "selective"])
    g.add_argument("--recompute-method", choices=["uniform", "block"])
    g.add_argument("--recompute-num-layers", type=int)
    g.add_argument("--recompute-modules", nargs="+",
                   help="with --recompute-granularity selective: the submodules megatron recomputes (default "
                        "core_attn; megatron's TransformerConfig lists the others)")
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="the loss averages over every token of the global batch, not per micro-batch first")
    g.add_argument("--manual-gc", action="store_true",
                   help="Python's garbage collector runs between steps only, at the same time on every rank")
    g.add_argument("--manual-gc-interval", type=int, default=0,
                   help="with --manual-gc: collect every this many iterations (0: only around evaluations)")
    g.add_argument("--no-manual-gc-eval", action="store_false", dest="manual_gc_eval",
                   help="with --manual-gc: no collection before and after each evaluation")
    g.add_argument("--seed", type=int, default=1234)


def _data(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", help="PREFIX, or WEIGHT PREFIX WEIGHT PREFIX ... for a blend")
    g.add_argument("--split", default="969,30,1")
    g.add_argument("--mock-data", action="store_true", help="synthetic tokens instead of --data-path")
    g.add_argument("--tokenizer-type", default="NullTokenizer",
                   choices=["SentencePieceTokenizer", "GPTSentencePieceTokenizer", "HuggingFaceTokenizer",
                            "NullTokenizer"])
    g.add_argument("--tokenizer-model")
    g.add_argument("--dataloader-type", choices=["single", "cyclic"], default="single")
    g.add_argument("--num-workers", type=int, default=0)
    g.add_argument("--data-cache-path")
    g.add_argument("--no-check-token-ids", action="store_false", dest="check_token_ids",
                   help="skip the scan of each --data-path .bin for token ids outside the model's vocabulary "
                        "before the first step: one read of the data on rank 0, about ten minutes per TB at 2 GB/s, "
                        "within --distributed-timeout-minutes (the .idx/.bin agreement is checked anyway)")
    g.add_argument("--reset-position-ids", action="store_true")
    g.add_argument("--reset-attention-mask", action="store_true")
    g.add_argument("--eod-mask-loss", action="store_true")
    g.add_argument("--create-attention-mask-in-dataloader", action="store_true",
                   help="make an [s, s] attention mask per sample and broadcast it with the batch (Megatron-LM's "
                        "default); the flow's causal models never read it, so it is off unless asked for")
    g.add_argument("--no-create-attention-mask-in-dataloader", action="store_false",
                   dest="create_attention_mask_in_dataloader", default=False,
                   help="the default here (Megatron-LM's flag, accepted)")


def _checkpointing(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("checkpointing")
    g.add_argument("--save")
    g.add_argument("--load")
    g.add_argument("--save-interval", type=int)
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--no-save-rng", action="store_true")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--finetune", action="store_true",
                   help="load the weights only and start at iteration 0")
    g.add_argument("--ckpt-format", choices=["torch_dist", "fsdp_dtensor"], default="torch_dist",
                   help="fsdp_dtensor: Megatron-FSDP's (torch.distributed.checkpoint of its DTensors), which it needs")
    g.add_argument("--ckpt-fully-parallel-save", action="store_true",
                   help="the data-parallel replicas share the writing of a save (Megatron-LM's default; off by "
                        "default here)")
    g.add_argument("--no-ckpt-fully-parallel-save", action="store_false", dest="ckpt_fully_parallel_save")
    g.add_argument("--ckpt-fully-parallel-load", action="store_true",
                   help="the data-parallel replicas share the reading of a load and exchange what they read")
    g.add_argument("--async-save", action="store_true",
                   help="write each save in a background process while training goes on (megatron's asynchronous "
                        "torch_dist save); it is published once every rank's writes are done")
    g.add_argument("--exit-interval", type=int, help="stop after the iteration divisible by this")


def _resilience(parser: argparse.ArgumentParser) -> None:
    """Preemption (adapter/training/preemption.py) and non-finite steps (nonfinite.py), Megatron-LM's names
    and defaults."""
    g = parser.add_argument_group("preemption and result validation")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on --exit-signal every rank finishes its iteration, the flow saves, and the job exits 0")
    g.add_argument("--exit-signal", default="SIGTERM",
                   help="the signal --exit-signal-handler catches (default SIGTERM)")
    g.add_argument("--exit-duration-in-mins", type=float,
                   help="save and exit before this many minutes from the launch have passed")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", action="store_false", dest="check_for_nan_in_loss_and_grad",
                   help="do not stop on a NaN or Inf loss or gradient norm (checked by default)")
    g.add_argument("--check-for-spiky-loss", action="store_true",
                   help="re-run a step whose loss is 10x the largest of the first 100 (non-fatal)")
    g.add_argument("--rerun-mode", choices=["disabled", "validate_results", "report_stats"],
                   default="validate_results", help="what megatron's rerun state machine does with a rejected result")
    g.add_argument("--error-injection-rate", type=int, default=0,
                   help="testing: inject a rejected result once in this many validations (0: never)")
    g.add_argument("--error-injection-type", choices=["correct_result", "transient_error", "persistent_error"],
                   default="transient_error")


def _logging(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("evaluation and logging")
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--tensorboard-dir")
    g.add_argument("--timing-log-level", type=int, choices=[0, 1, 2], default=0)


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors, like every refusal here, are printed by rank 0 only (exit status 2 on
    every rank): each rank parses the same command line and reaches the same verdict."""

    def error(self, message: str) -> NoReturn:
        if _rank() == 0:
            self.print_usage(sys.stderr)
            print(f"{self.prog}: error: {message}", file=sys.stderr, flush=True)
        raise SystemExit(2)

    def _check_value(self, action: argparse.Action, value) -> None:
        """A value outside this flow's choices that Megatron-LM's flag takes (``--moe-token-dispatcher-type
        flex``) is refused in one line naming where it runs, as a flag this flow lacks is."""
        try:
            super()._check_value(action, value)
        except argparse.ArgumentError:
            from adapter.training.megatron_lm_flags import value_refusal

            line = value_refusal(action.option_strings[-1], value, action.choices) if action.option_strings else None
            if line is not None:
                refuse(ArgumentError(line))
            raise


def build_parser(extra_args_provider=None) -> argparse.ArgumentParser:
    parser = _Parser(description="Megatron-LM-style pretraining through the device adapter",
                                     allow_abbrev=False)
    for add in (_model, _moe, _parallel, _training, _data, _checkpointing, _resilience, _logging,
                offloading.add_arguments):
        add(parser)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    return parser


def parse_args(argv=None, extra_args_provider=None, defaults: dict | None = None) -> argparse.Namespace:
    parser = build_parser(extra_args_provider)
    if defaults:
        parser.set_defaults(**defaults)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        from adapter.training.megatron_lm_flags import refusal_for

        line = refusal_for(unknown)
        if line is None:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        refuse(ArgumentError(line))
    return args


def refuse(exc: Exception) -> NoReturn:
    """Stop on arguments that cannot run: one ``error:`` line from rank 0, exit status 2 on every rank.

    Every rank reaches the same verdict from the same arguments before any process group exists, so no
    rank is left waiting for another and the user reads the reason once, not once per rank."""
    if _rank() == 0:
        print(f"error: {exc}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ArgumentError(message)


def validate_args(args: argparse.Namespace, world_size: int | None = None) -> argparse.Namespace:
    """Check the arguments against each other and the world size, one concern per check, before anything
    is built; fills in what Megatron-LM derives (data-parallel size, virtual pipeline size, params dtype,
    warmup and decay iterations, the NullTokenizer's vocabulary, the model config). The one check that
    needs the built tokenizer is ``fit_vocab``."""
    world_size = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    _check_sizes(args)
    _check_parallel_sizes(args, world_size)
    _check_model(args)
    _check_experts(args)
    _check_virtual_pipeline(args)
    _check_context_parallel(args)
    _check_batches(args)
    _check_sharded_data_parallel(args)
    _check_precision_and_overlap(args)
    _check_schedule(args)
    _check_data(args)
    _check_checkpoints(args)
    _check_resilience(args)
    offloading.check(args, ArgumentError)
    return args


POSITIVE = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
            "virtual_pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage", "micro_batch_size",
            "global_batch_size", "seq_length", "num_layers", "hidden_size", "ffn_hidden_size",
            "num_attention_heads", "num_query_groups", "max_position_embeddings", "vocab_size", "rotary_base",
            "norm_epsilon", "make_vocab_size_divisible_by", "ddp_bucket_size", "distributed_timeout_minutes",
            "log_interval", "eval_interval", "save_interval", "exit_interval", "loss_scale", "initial_loss_scale",
            "loss_scale_window", "recompute_num_layers", "expert_model_parallel_size", "expert_tensor_parallel_size",
            "moe_ffn_hidden_size", "moe_router_topk", "kv_channels", "exit_duration_in_mins",
            "moe_router_num_groups", "moe_router_group_topk", "decoder_first_pipeline_num_layers",
            "decoder_last_pipeline_num_layers", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
            "v_head_dim", "mtp_num_layers")
NOT_NEGATIVE = ("train_iters", "lr", "min_lr", "lr_decay_iters", "lr_warmup_iters", "lr_warmup_fraction",
                "lr_warmup_init", "weight_decay", "clip_grad", "eval_iters", "num_workers", "hidden_dropout",
                "attention_dropout", "init_method_std", "hysteresis", "min_loss_scale", "num_experts",
                "moe_shared_expert_intermediate_size", "moe_z_loss_coeff", "moe_router_bias_update_rate",
                "error_injection_rate", "manual_gc_interval", "mtp_loss_scaling_factor", "mscale", "mscale_all_dim")


def _check_sizes(args: argparse.Namespace) -> None:
    """Sizes, counts and intervals are positive (rates and counts that may be zero, not negative)."""
    for names, bad, need in ((POSITIVE, lambda v: v <= 0, "positive"),
                             (NOT_NEGATIVE, lambda v: v < 0, "zero or more")):
        for name in names:
            value = getattr(args, name, None)
            _require(value is None or not bad(value), f"--{name.replace('_', '-')} {value}: must be {need}")


def _check_parallel_sizes(args: argparse.Namespace, world_size: int) -> None:
    args.data_parallel_size = _layout(args, world_size)
    args.world_size = world_size
    if args.sequence_parallel and args.tensor_model_parallel_size == 1:
        args.sequence_parallel = False  # as Megatron-LM: nothing to split over
    _require(args.distributed_backend is None or _backend_matches(args.distributed_backend),
             f"--distributed-backend {args.distributed_backend} does not match the adapter's backend "
             f"({_backend_name()}): leave it out, the adapter picks the collective library")


def _check_model(args: argparse.Namespace) -> None:
    """The named model exists; the architecture is whole and consistent. The NullTokenizer's vocabulary
    defaults to the named model's (less the end-of-document id it adds); the embedding rows are the named
    model's, else the vocabulary padded as Megatron-LM pads it (``fit_vocab`` redoes that once a file
    tokenizer is loaded)."""
    if args.use_rotary_position_embeddings and args.position_embedding_type is None:
        args.position_embedding_type = "rope"
    _require(args.model is not None or args.num_layers is not None,
             "no model: pass --model NAME (one of " + ", ".join(models.names()) + ") or the architecture "
             "arguments (--num-layers, --hidden-size, --num-attention-heads, ...)")
    _require(args.seq_length is not None or args.model is not None, "--seq-length is required")
    named = _named_model(args)
    if args.tokenizer_type == "NullTokenizer" and args.vocab_size is None and named is not None:
        args.vocab_size = named.vocab_size - 1
    known_vocab = args.vocab_size + 1 if args.tokenizer_type == "NullTokenizer" and args.vocab_size else None
    _set_model_config(args, known_vocab or args.vocab_size or _vocab_multiple(args))


def _named_model(args: argparse.Namespace):
    if args.model is None:
        return None
    try:
        return models.get(args.model)
    except models.ModelConfigError as exc:
        raise ArgumentError(f"--model {args.model}: {exc}") from exc


def _vocab_multiple(args: argparse.Namespace) -> int:
    return args.make_vocab_size_divisible_by * args.tensor_model_parallel_size


def _set_model_config(args: argparse.Namespace, tokenizer_vocab: int) -> None:
    named = _named_model(args)
    if named is not None:
        _require(tokenizer_vocab <= named.vocab_size,
                 f"the tokenizer has {tokenizer_vocab} entries, more than the {named.vocab_size} embedding rows "
                 f"of {args.model}: use the model's tokenizer or override --vocab-size")
        args.padded_vocab_size = named.vocab_size
    else:
        args.padded_vocab_size = -(-tokenizer_vocab // _vocab_multiple(args)) * _vocab_multiple(args)
    try:
        from models.provider import config_from_args  # imports megatron: only once arguments are parsed

        args.model_config = config_from_args(args)
    except models.ModelConfigError as exc:
        raise ArgumentError(str(exc)) from exc
    args.seq_length = args.model_config.seq_length


def fit_vocab(args: argparse.Namespace, tokenizer_vocab: int) -> None:
    """Size the embedding for the built tokenizer, the one thing ``validate_args`` could not know: a named
    model's rows must hold it; otherwise the tokenizer's vocabulary padded to --make-vocab-size-divisible-by
    x TP, as Megatron-LM does (a multiple of TP: the layout rules that ran in ``validate_args`` still hold)."""
    if args.model is not None:
        _require(tokenizer_vocab <= args.model_config.vocab_size,
                 f"the tokenizer has {tokenizer_vocab} entries, more than the {args.model_config.vocab_size} "
                 f"embedding rows of {args.model}: use the model's tokenizer or override --vocab-size")
        return
    args.padded_vocab_size = -(-tokenizer_vocab // _vocab_multiple(args)) * _vocab_multiple(args)
    args.model_config = args.model_config.replace(vocab_size=args.padded_vocab_size)


def _check_context_parallel(args: argparse.Namespace) -> None:
    """What the adapter's CP attention and megatron's load-balanced split need, refused here rather than
    as an assertion inside the first forward: a communication type the attention has, heads that Ulysses
    can spread over the CP ranks (the sequence's 2 x CP chunks and its split over TP are layout rules),
    no attention dropout and no document masks (the CP attention is causal over the whole
    sequence, without dropout). Sets ``args.cp_comm_type`` to the one type as a string, the form megatron's
    layers read (a per-layer list there is indexed by layer number, one off)."""
    types = args.cp_comm_type if isinstance(args.cp_comm_type, list) else [args.cp_comm_type]
    cp, tp, model = args.context_parallel_size, args.tensor_model_parallel_size, args.model_config
    _require(len(set(types)) == 1, f"--cp-comm-type {' '.join(types)}: one type for every layer is supported; "
                                   "give one of " + ", ".join(SUPPORTED_CP_COMM_TYPES))
    _require(len(types) in (1, model.num_layers),
             f"--cp-comm-type with {len(types)} values for {model.num_layers} layers: give one, or one per layer")
    args.cp_comm_type = types[0]
    if cp == 1:
        return
    _require(args.cp_comm_type in SUPPORTED_CP_COMM_TYPES,
             f"--cp-comm-type {args.cp_comm_type}: not supported by the adapter's CP attention: use p2p or a2a")
    key, value = model.qk_head_dim + model.qk_pos_emb_head_dim, model.v_head_dim
    _require(not model.multi_latent_attention or not context_parallel.ring_refuses(key, value, [args.cp_comm_type]),
             f"--context-parallel-size {cp} --cp-comm-type p2p with multi-latent attention's key heads of {key} and "
             f"value heads of {value}: {context_parallel.RING_HEAD_SIZES}; use --cp-comm-type a2a")
    heads, groups = model.num_attention_heads // tp, model.num_query_groups // tp
    _require(args.cp_comm_type != "a2a" or (heads % cp == 0 and groups % cp == 0),
             f"--cp-comm-type a2a spreads each TP rank's {heads} attention heads and {groups} query groups over "
             f"CP {cp}, which does not divide them: use --cp-comm-type p2p or a CP size dividing both")
    _require(args.attention_dropout == 0,
             f"--attention-dropout {args.attention_dropout} with --context-parallel-size {cp}: the CP attention has "
             "no attention dropout; pass --attention-dropout 0")
    _require(not args.reset_attention_mask,
             f"--reset-attention-mask with --context-parallel-size {cp}: the CP attention is causal over the whole "
             "sequence and takes no document masks; drop --reset-attention-mask or use CP 1")


def _check_experts(args: argparse.Namespace) -> None:
    """What megatron would refuse about the experts once the model is built (TransformerConfig's
    ``__post_init__``, the MoE layer's first training step), or silently not use; then the expert tensor
    parallel size defaults to TP, as in Megatron-LM. EP dividing the experts, and ETP their FFN, is the
    layout check (``_check_layout``)."""
    model, tp = args.model_config, args.tensor_model_parallel_size
    if model.num_experts is None:
        _refuse_expert_arguments(args)
        return
    _require(tp == 1 or args.sequence_parallel,
             f"a MoE model at TP {tp} needs --sequence-parallel: megatron's MoE layer refuses to train with tensor "
             "parallelism without it")
    _require(not args.moe_pad_expert_input_to_capacity or args.moe_expert_capacity_factor is not None,
             "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor (the capacity it pads to)")
    if args.moe_shared_expert_overlap:
        _require(model.moe_shared_expert_intermediate_size is not None,
                 "--moe-shared-expert-overlap without a shared expert: set --moe-shared-expert-intermediate-size")
        _require(args.moe_token_dispatcher_type == "alltoall",
                 f"--moe-shared-expert-overlap runs the shared expert during the all-to-all, which the "
                 f"{args.moe_token_dispatcher_type} dispatcher has not: use --moe-token-dispatcher-type alltoall")
    if args.moe_expert_capacity_factor is not None and args.moe_expert_capacity_factor < 0:
        args.moe_expert_capacity_factor = None  # Megatron-LM's meaning of a negative factor: drop no token
    _check_load_balancing(args)
    _check_group_limited_routing(args)
    args.expert_tensor_parallel_size = args.expert_tensor_parallel_size or tp


def _check_group_limited_routing(args: argparse.Namespace) -> None:
    """Megatron's group-limited top-k: the experts split into --moe-router-num-groups equal groups, each token
    picks --moe-router-group-topk of them and its top-k experts spread evenly over those."""
    groups, picked = args.moe_router_num_groups, args.moe_router_group_topk
    model = args.model_config
    if groups is None and picked is None:  # the named model's, which it has checked
        args.moe_router_num_groups = model.moe_router_num_groups
        args.moe_router_group_topk = model.moe_router_group_topk
        return
    experts, topk = model.num_experts, model.moe_router_topk
    _require(groups is not None and picked is not None,
             "--moe-router-num-groups and --moe-router-group-topk go together: give both")
    _require(experts % groups == 0, f"--moe-router-num-groups {groups} does not divide the {experts} experts")
    _require(picked <= groups and topk % picked == 0,
             f"--moe-router-group-topk {picked}: must be at most --moe-router-num-groups {groups} and divide "
             f"--moe-router-topk {topk}")
    args.model_config = model.replace(moe_router_num_groups=groups, moe_router_group_topk=picked)


def _check_load_balancing(args: argparse.Namespace) -> None:
    """One aux-loss coefficient per load-balancing type, none negative; a single one of each is a plain
    value, as Megatron-LM makes it. Without --moe-aux-loss-coeff the coefficient is the model's
    (``ModelConfig.moe_aux_loss_coeff``, what it was published with), which names no type: several types
    still need one coefficient each."""
    types, coeffs = args.moe_router_load_balancing_type, args.moe_aux_loss_coeff
    given = coeffs is not None
    if not given:
        coeffs = args.model_config.moe_aux_loss_coeff
    types, coeffs = (types if isinstance(types, list) else [types]), (coeffs if isinstance(coeffs, list) else [coeffs])
    _require(len(types) == len(coeffs),
             f"--moe-router-load-balancing-type {' '.join(types)} with "
             + (f"--moe-aux-loss-coeff {' '.join(map(str, coeffs))}" if given else
                f"the model's one aux-loss coefficient ({coeffs[0]})") + ": give one coefficient per type")
    _require(all(c >= 0 for c in coeffs), f"--moe-aux-loss-coeff {' '.join(map(str, coeffs))}: must be zero or more")
    args.moe_router_load_balancing_type = types[0] if len(types) == 1 else types
    args.moe_aux_loss_coeff = coeffs[0] if len(coeffs) == 1 else coeffs


def _refuse_expert_arguments(args: argparse.Namespace) -> None:
    """A dense model with expert-parallel or MoE training arguments off their defaults: Megatron-LM would
    ignore them (or fail on EP > 1); here they name the missing --num-experts."""
    parser = build_parser()
    given = [f"--{name.replace('_', '-')}" for name, value in sorted(vars(args).items())
             if (name.startswith("moe_") or name.startswith("expert_")) and value != parser.get_default(name)]
    _require(not given, f"{', '.join(given)} for a dense model: pass --num-experts N (or a MoE --model), or drop "
                        f"{'it' if len(given) == 1 else 'them'}")


def _check_virtual_pipeline(args: argparse.Namespace) -> None:
    pp, model = args.pipeline_model_parallel_size, args.model_config
    uneven = pipeline_split(args) != PipelineSplit()
    _require(not uneven or pp > 1, "an uneven pipeline split (--decoder-first/last-pipeline-num-layers, "
                                   "--account-for-*-in-pipeline-split) needs --pipeline-model-parallel-size > 1")
    _require(not uneven or model.layer_types is None, "an uneven pipeline split of a hybrid model (its mixers and "
                                                      "MLPs are megatron layers of their own): use the even split")
    if args.num_layers_per_virtual_pipeline_stage is not None:
        _require(pp > 1, "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1")
        _require(not uneven, "--num-layers-per-virtual-pipeline-stage with an uneven pipeline split: give "
                             "--virtual-pipeline-model-parallel-size instead (as Megatron-LM asks)")
        per_stage, per_chunk = model.num_layers // pp, args.num_layers_per_virtual_pipeline_stage
        _require(model.num_layers % pp == 0 and per_stage % per_chunk == 0,
                 f"{model.num_layers} layers over PP {pp} cannot be cut into virtual stages of {per_chunk} "
                 "layers: choose a --num-layers-per-virtual-pipeline-stage dividing num_layers / PP")
        vpp = per_stage // per_chunk
        _require(args.virtual_pipeline_model_parallel_size in (None, vpp),
                 f"--virtual-pipeline-model-parallel-size {args.virtual_pipeline_model_parallel_size} "
                 f"contradicts --num-layers-per-virtual-pipeline-stage {per_chunk} (which gives {vpp})")
        args.virtual_pipeline_model_parallel_size = vpp
    if args.virtual_pipeline_model_parallel_size == 1:
        args.virtual_pipeline_model_parallel_size = None
    _check_layout(args)


def _check_layout(args: argparse.Namespace) -> None:
    """The layout against the model (heads, groups, widths, layers, experts, sequence)."""
    _layout(args, None, args.model_config.shape())


def _layout(args: argparse.Namespace, world_size: int | None, model: ModelShape | None = None) -> int | None:
    """``adapter.parallel.check_sizes``, the one home of the layout rules, over these arguments."""
    vpp = args.virtual_pipeline_model_parallel_size if model is not None else None  # settled by then
    try:
        return check_sizes(world_size, tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
                           vpp=vpp, cp=args.context_parallel_size, ep=args.expert_model_parallel_size,
                           etp=args.expert_tensor_parallel_size, model=model,
                           sequence_parallel=bool(args.sequence_parallel),
                           split=pipeline_split(args) if model is not None else PipelineSplit())
    except ParallelConfigError as exc:
        raise ArgumentError(str(exc)) from None


def pipeline_split(args: argparse.Namespace) -> PipelineSplit:
    """Megatron-LM's uneven pipeline split from its flags (the even split where none is given)."""
    return PipelineSplit(first=args.decoder_first_pipeline_num_layers, last=args.decoder_last_pipeline_num_layers,
                         embedding=args.account_for_embedding_in_pipeline_split,
                         loss=args.account_for_loss_in_pipeline_split)


def _check_batches(args: argparse.Namespace) -> None:
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    per_step = args.micro_batch_size * args.data_parallel_size
    _require(args.global_batch_size % per_step == 0,
             f"global batch {args.global_batch_size} is not divisible by micro batch {args.micro_batch_size} x "
             f"data-parallel size {args.data_parallel_size} = {per_step}: change --global-batch-size or "
             "--micro-batch-size")
    args.num_micro_batches = args.global_batch_size // per_step
    pp = args.pipeline_model_parallel_size
    if args.virtual_pipeline_model_parallel_size is not None:
        _require(args.num_micro_batches % pp == 0,
                 f"the interleaved schedule needs the number of micro-batches ({args.num_micro_batches}) to be "
                 f"a multiple of PP {pp}: change --global-batch-size")


def _check_sharded_data_parallel(args: argparse.Namespace) -> None:
    """Megatron-LM's checks of --use-megatron-fsdp and --use-torch-fsdp2 (its ``validate_args``), each one
    line. Megatron-FSDP runs with the distributed optimizer (switched on, as Megatron-LM does) and saves
    fsdp_dtensor checkpoints, a format only it writes; FSDP2 shards the optimizer state itself (no distributed
    optimizer), saves torch_dist, and needs untied embeddings and one pipeline stage and expert rank."""
    mfsdp, fsdp2 = args.use_megatron_fsdp, args.use_torch_fsdp2
    _require(not (mfsdp and fsdp2), "--use-megatron-fsdp and --use-torch-fsdp2 together: choose one")
    _require(args.ckpt_format != "fsdp_dtensor" or mfsdp,
             "--ckpt-format fsdp_dtensor is Megatron-FSDP's format: add --use-megatron-fsdp or use torch_dist")
    if mfsdp:
        _require(args.ckpt_format == "fsdp_dtensor", f"--use-megatron-fsdp with --ckpt-format {args.ckpt_format}: "
                                                     "Megatron-FSDP requires --ckpt-format fsdp_dtensor")
        _require(not (args.async_save or args.ckpt_fully_parallel_save or args.ckpt_fully_parallel_load),
                 "--async-save and --ckpt-fully-parallel-save/load are torch_dist's: with --ckpt-format fsdp_dtensor "
                 "every rank writes and reads its own shards synchronously; drop them")
        args.use_distributed_optimizer = True
        _require_einops()
    if not fsdp2:
        return
    for bad, message in ((args.pipeline_model_parallel_size > 1, "pipeline parallelism (use PP 1)"),
                         (args.expert_model_parallel_size > 1, "expert parallelism (use EP 1)"),
                         (args.use_distributed_optimizer, "megatron's distributed optimizer (FSDP2 shards the "
                                                          "optimizer state itself): drop --use-distributed-optimizer"),
                         (args.gradient_accumulation_fusion, "gradient accumulation fusion: pass "
                                                             "--no-gradient-accumulation-fusion"),
                         (args.fp16, "--fp16 (Megatron-LM's FSDP2 does not run it): use --bf16"),
                         (args.model_config.tie_embeddings, "tied embedding and output weights: pass "
                                                            "--untie-embeddings-and-output-weights")):
        _require(not bad, f"--use-torch-fsdp2 with {message}")


def _require_einops() -> None:
    """Megatron-FSDP's mesh needs einops, which megatron-core does not install: the adapter's one line."""
    from adapter import sharding
    from adapter.cuda_only_features import RefusedSetting

    try:
        sharding.require_einops()
    except RefusedSetting as exc:
        raise ArgumentError(str(exc)) from None


def _check_precision_and_overlap(args: argparse.Namespace) -> None:
    import torch

    _require(not (args.bf16 and args.fp16), "--bf16 and --fp16 together: choose one")
    args.params_dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    _require(not args.overlap_param_gather or args.use_distributed_optimizer,
             "--overlap-param-gather needs --use-distributed-optimizer")
    if args.recompute_granularity == "full":
        _require(args.recompute_method is not None, "--recompute-granularity full needs --recompute-method")


def _check_schedule(args: argparse.Namespace) -> None:
    _require(args.train_iters is not None, "--train-iters is required (iterations)")
    _require(args.lr is not None, "--lr is required")
    _require(args.lr_warmup_fraction is None or args.lr_warmup_iters == 0,
             "--lr-warmup-fraction and --lr-warmup-iters together: give one")
    args.lr_decay_iters = args.lr_decay_iters or args.train_iters
    _require(args.lr_decay_iters > 0, f"--train-iters {args.train_iters} without --lr-decay-iters: the LR schedule "
                                      "needs at least one iteration to decay over")
    if args.lr_warmup_fraction is not None:
        args.lr_warmup_iters = int(args.lr_warmup_fraction * args.lr_decay_iters)
    # megatron's OptimizerParamScheduler asserts warm-up < decay
    _require(args.lr_warmup_iters < args.lr_decay_iters,
             f"--lr-warmup-iters {args.lr_warmup_iters}: must be fewer than the {args.lr_decay_iters} decay iterations "
             "(--lr-decay-iters, default --train-iters)")


def _check_data(args: argparse.Namespace) -> None:
    """One data source whose files exist, and a tokenizer file where the type needs one."""
    _require(bool(args.mock_data) != bool(args.data_path), "give exactly one of --data-path and --mock-data")
    if args.data_path and len(args.data_path) > 1:
        _require(len(args.data_path) % 2 == 0, "--data-path with several datasets is WEIGHT PREFIX pairs")
    prefixes = args.data_path[1::2] if args.data_path and len(args.data_path) > 1 else args.data_path or []
    for prefix in prefixes:
        try:
            check_files(prefix)
        except DataError as exc:
            raise ArgumentError(str(exc)) from None
    if args.tokenizer_type != "NullTokenizer":
        _require(args.tokenizer_model is not None, f"--tokenizer-type {args.tokenizer_type} needs --tokenizer-model")


def _check_checkpoints(args: argparse.Namespace) -> None:
    """--save-interval has a directory; a --load tracker names a checkpoint that is there."""
    if args.save_interval is not None:
        _require(args.save is not None, "--save-interval needs --save (the directory)")
    if args.load:
        try:
            checkpoint_dir.checkpoint_to_load(args.load, recoverable=_same_dir(args.load, args.save))
        except checkpoint_dir.CheckpointError as exc:
            raise ArgumentError(f"--load {args.load}: {exc}") from exc


def _check_resilience(args: argparse.Namespace) -> None:
    """--exit-signal names a signal a process can catch (it becomes a ``signal.Signals``); fp16's dynamic loss
    scaling turns the NaN check off, as in Megatron-LM: there a NaN gradient is the scaler's signal to skip."""
    if not isinstance(args.exit_signal, signal.Signals):
        name = str(args.exit_signal).upper()
        catchable = signal.Signals.__members__.get(name) not in (None, signal.SIGKILL, signal.SIGSTOP)
        _require(catchable, f"--exit-signal {args.exit_signal}: not a signal a process can catch; give its name, "
                            "e.g. SIGTERM (the default, what schedulers and torchrun send), SIGINT, SIGUSR1, SIGUSR2")
        args.exit_signal = signal.Signals[name]
    if args.fp16 and args.loss_scale is None:
        args.check_for_nan_in_loss_and_grad = False
    _require(args.rerun_mode != "report_stats" or _reports_stats(),
             "--rerun-mode report_stats: this megatron-core's rerun state machine fails as it reports them (it reads "
             "caller.filename, which its Caller lacks; fixed by megatron-core 0.19); use validate_results or disabled")


def _reports_stats() -> bool:
    """Whether megatron's machine can report determinism stats: 0.16.1's reads fields its Caller lacks."""
    import inspect

    from megatron.core.rerun_state_machine import Caller, RerunStateMachine

    return "filename" in Caller._fields or "caller.filename" not in inspect.getsource(RerunStateMachine)


def _same_dir(a: str | None, b: str | None) -> bool:
    return bool(a and b) and os.path.realpath(a) == os.path.realpath(b)


def _backend_name() -> str:
    import adapter

    return adapter.current_backend().dist_backend


def _backend_matches(requested: str) -> bool:
    return requested == _backend_name()

"""The flow's table of bad arguments (scripts/pretrain_gpt.py on megatron.training's own parser, issue 50):
each is refused in one ``error:`` line naming the value, exit status 2 on every rank, no traceback. Most are
megatron's own checks (``validate_args``, TransformerConfig, its tokenizer), said in one line by
``input_refusals``; the rest are checks megatron lacks where it crashes later (adapter/input_refusals.py), and
the adapter's CP attention's own limits (adapter/kernels/context_parallel.py).

In process through the wheel's megatron.training (``parse_and_validate_args``, the config, the tokenizer), as
``flow.pretrain.run`` calls it; a few rows on 2-rank launches of scripts/pretrain_gpt.py."""

from __future__ import annotations

import sys

import pytest

from adapter.cuda_only_features import RefusedSetting
from tests.distributed import launch_script

BASE = ["--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "1", "--lr", "1e-3", "--mock-data",
        "--eval-interval", "1", "--eval-iters", "1"]
TINY = ["--model", "qwen2.5-tiny", *BASE]  # 4 layers, 4 heads in 2 query groups, attention dropout 0.1; its vocabulary
BARE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
        "--seq-length", "32", "--max-position-embeddings", "64", "--tokenizer-type", "NullTokenizer", "--vocab-size",
        "1000", *BASE]
MOE = ["--model", "qwen3-moe-tiny", *BASE]  # 8 experts, top-2
CP = [*TINY, "--context-parallel-size", "2", "--attention-dropout", "0"]

# (arguments, world size, the line's start)
REFUSED = [
    (["--model", "qwen9-huge", *BASE], 2, "--model qwen9-huge: unknown model 'qwen9-huge': known models are"),
    ([*BARE, "--tensor-model-parallel-size", "0"], 2, "--tensor-model-parallel-size 0: must be positive"),
    ([*TINY, "--pipeline-model-parallel-size", "-1"], 2, "--pipeline-model-parallel-size -1: must be positive"),
    ([*TINY, "--micro-batch-size", "0"], 2,
     "--micro-batch-size 0: Megatron-LM's validate_args requires micro_batch_size > 0"),
    ([*TINY, "--hidden-size", "0"], 2, "--hidden-size 0: must be positive"),
    ([*BARE, "--seq-length", "-32"], 2, "--seq-length -32: must be positive"),
    ([*TINY, "--lr", "-1"], 2, "--lr -1.0, --min-lr 0.0: Megatron-LM's validate_args requires min_lr <= lr"),
    ([*TINY, "--eval-interval", "0"], 2, "--eval-interval 0: must be positive"),
    ([*TINY, "--global-batch-size", "6"], 2,
     "--eval-global-batch-size 6, --eval-micro-batch-size 2, data_parallel_size=2: eval_global_batch_size (6) "
     "must be divisible by eval_micro_batch_size (2) * data_parallel_size (2)"),
    ([*TINY, "--tensor-model-parallel-size", "3"], 6, "--num-attention-heads 4, --tensor-model-parallel-size 3: "
                                                      "num_attention_heads (4) must be a multiple of"),
    ([*TINY, "--tensor-model-parallel-size", "2"], 3, "world_size=3: world size (3) is not divisible by"),
    ([*TINY, "--bf16", "--fp16"], 2, "--fp16, --bf16: Megatron-LM's validate_args requires not bf16 when fp16"),
    ([*TINY, "--overlap-param-gather"], 2, "--overlap-param-gather, without --use-distributed-optimizer"),
    ([*TINY, "--data-path", "x"], 2, "--mock-data, --data-path x, "),
    ([*TINY, "--num-layers-per-virtual-pipeline-stage", "3", "--pipeline-model-parallel-size", "2"], 2,
     "--num-layers-per-virtual-pipeline-stage 3: number of layers per pipeline stage must be divisible"),
    ([*TINY, "--context-parallel-size", "2"], 2,
     "--attention-dropout 0.1 with --context-parallel-size 2: the adapter's context-parallel attention has no "
     "attention dropout: pass --attention-dropout 0"),
    ([*TINY, "--tokenizer-type", "GPTSentencePieceTokenizer"], 2,
     "--tokenizer-type GPTSentencePieceTokenizer, --tokenizer-model unset: Tokenizer path must be specified."),
    ([*TINY, "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", "/no/such.model"], 2,
     "--tokenizer-type GPTSentencePieceTokenizer, --tokenizer-model /no/such.model: tokenizer_path: "
     "/no/such.model is invalid"),
    ([*TINY, "--kv-channels", "0"], 2, "--kv-channels 0: must be positive"),
    ([*BARE, "--num-attention-heads", "3"], 2, "--hidden-size 64, --num-attention-heads 3: Megatron-LM's "
                                                "validate_args requires hidden_size % num_attention_heads == 0"),
    ([*CP, "--cp-comm-type", "allgather"], 2, "--cp-comm-type allgather: the adapter's context-parallel attention "
                                              "runs p2p (ring) and a2a (Ulysses): use those"),
    ([*CP, "--cp-comm-type", "p2p", "a2a"], 2,
     "--cp-comm-type p2p a2a, --num-layers 4: Length of cp_comm_type (2) should equal to the total number"),
    ([*CP, "--tensor-model-parallel-size", "2", "--cp-comm-type", "a2a"], 4,
     "--cp-comm-type a2a with --context-parallel-size 2: Ulysses spreads each TP rank's 2 attention heads and 1 "
     "query groups over the CP ranks, which 2 does not divide"),
    ([*TINY, "--context-parallel-size", "2", "--seq-length", "30"], 2,
     "--seq-length 30, --context-parallel-size 2: seq-length should be a multiple of 2 * context-parallel-size"),
    ([*TINY, "--exit-signal-handler", "--exit-signal", "SIGFOO"], 2,
     "argument --exit-signal: 'SIGFOO' is not one of SIGHUP, "),
    ([*TINY, "--manual-gc", "--manual-gc-interval", "-1"], 2, "--manual-gc-interval -1: must be 0 or more"),
    ([*TINY, "--moe-router-num-groups", "2", "--moe-router-group-topk", "1"], 2,
     "--moe-router-num-groups 2, --moe-router-group-topk 1 without --num-experts: group-limited routing"),
    ([*TINY, "--decoder-first-pipeline-num-layers", "1"], 2,
     "Mismatch: 3 middle layers remaining but 0 middle PP stages available."),
    ([*TINY, "--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "3",
      "--decoder-last-pipeline-num-layers", "2"], 2, "Mismatch: -1 middle layers remaining"),
    ([*TINY, "--pipeline-model-parallel-size", "2", "--account-for-embedding-in-pipeline-split"], 2,
     "--num-layers 4, transformer_pipeline_model_parallel_size=2: Number of layers should be divisible by"),
    ([*TINY, "--pipeline-model-parallel-size", "2", "--account-for-embedding-in-pipeline-split",
      "--decoder-last-pipeline-num-layers", "2"], 2, "--account-for-embedding-in-pipeline-split, without "
                                                     "--account-for-loss-in-pipeline-split: num_layers_in_first"),
    ([*TINY, "--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "1",
      "--num-layers-per-virtual-pipeline-stage", "1"], 2,
     "--decoder-first-pipeline-num-layers 1, --decoder-last-pipeline-num-layers unset: please use "
     "--num-virtual-stages-per-pipeline-rank"),
    ([*BARE, "--multi-latent-attention", "--disable-bias-linear", "--context-parallel-size", "2",
      "--attention-dropout", "0"], 2, "--multi-latent-attention (query/key head size 192 = --qk-head-dim + "
                                      "--qk-pos-emb-head-dim, value head size 128) with --context-parallel-size 2"),
    ([*MOE, "--moe-router-num-groups", "3", "--moe-router-group-topk", "1"], 2,
     "--moe-router-group-topk 1, --moe-router-num-groups 3: num_moe_experts (8) should be divisible by"),
    ([*TINY, "--no-such-flag"], 2, "unrecognized arguments: --no-such-flag (--help lists the flags)"),
    # a tokenizer larger than the named model's embedding (--model sets --padded-vocab-size to its rows)
    ([*TINY, "--vocab-size", "100000"], 2, "--padded-vocab-size 512: the tokenizer (NullTokenizer) has 100000 "
                                            "entries, more than the embedding's 512 rows"),
]


@pytest.fixture(autouse=True)
def _fresh_megatron_globals(monkeypatch):
    """megatron.training's globals (arguments, tokenizer, micro-batch calculator) set by one parse, unset for
    the next; CUDA_DEVICE_MAX_CONNECTIONS, which validate_args sets off CUDA, restored (see
    tests/test_input_refusals.py)."""
    from megatron.core import num_microbatches_calculator
    from megatron.training import global_vars

    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    yield
    global_vars.unset_global_variables()
    num_microbatches_calculator.unset_num_microbatches_calculator()


def parse_as_the_flow(monkeypatch, argv: list[str], world: int):
    """What ``flow.pretrain.run`` does before ``pretrain``, at ``world`` ranks, as rank 0: the arguments
    expanded, parsed and validated, the GPT config built from them."""
    from megatron.training.argument_utils import gpt_config_from_args
    from megatron.training.arguments import parse_and_validate_args

    from flow import model_flags, releases

    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *model_flags.expand(argv)])
    args = parse_and_validate_args(args_defaults=releases.ARGS_DEFAULTS)
    return args, gpt_config_from_args(args)


@pytest.mark.parametrize("argv, world, line", REFUSED, ids=[line[:40] for _, _, line in REFUSED])
def test_each_refusal_is_one_line_naming_the_value(monkeypatch, capsys, argv, world, line):
    with pytest.raises(RefusedSetting) as refused:
        parse_as_the_flow(monkeypatch, argv, world)
    assert str(refused.value).startswith(line) and "\n" not in str(refused.value), str(refused.value)
    assert "usage:" not in capsys.readouterr().err


# what the old loop refused and megatron.training takes: it trains on them (2-rank runs), or, without a
# checkpoint directory, a time limit (0 is none), error injection or --exit-signal-handler, does nothing with them
TAKEN = [["--save-interval", "5"], ["--exit-duration-in-mins", "0"],
         ["--error-injection-rate", "-1"], ["--exit-signal", "SIGKILL"], ["--log-params-norm"]]


@pytest.mark.parametrize("extra", TAKEN, ids=[extra[0] for extra in TAKEN])
def test_what_only_the_old_loop_refused_is_taken(monkeypatch, extra):
    args, _ = parse_as_the_flow(monkeypatch, [*TINY, *extra], 2)
    assert getattr(args, extra[0][2:].replace("-", "_")) is not None


# one per place a refusal comes from: the flow's --model, megatron's validate_args, a check megatron lacks, the
# adapter's CP attention, megatron-core's config, argparse: each costs two fresh interpreters
LAUNCHED = [REFUSED[i] for i in (0, 3, 7, 15, 21, 34)]


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("argv, world, line", LAUNCHED, ids=[line[:40] for _, _, line in LAUNCHED])
def test_two_ranks_refuse_with_one_error_line_and_no_traceback(argv, world, line):
    ranks = launch_script("scripts/pretrain_gpt.py", argv)
    output = "".join(output for _, output in ranks)
    assert [status for status, _ in ranks] == [2, 2], output[-3000:]
    errors = [text for text in output.splitlines() if "error:" in text]
    assert errors == [errors[0]] and errors[0].startswith(f"error: {line}"), output[-3000:]
    assert "Traceback" not in output and "usage:" not in output, output[-3000:]

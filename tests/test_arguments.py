"""Bad arguments are refused before any rank does work: one ``error:`` line naming the value and the fix,
from one process, exit status 2 on every rank, no traceback. The table is checked in process against the
own loop's ``validate_args`` (each concern's message); what a user of scripts/pretrain_gpt.py (now
megatron.training's ``pretrain``) sees on 2-rank launches is tests/test_flow_arguments.py's."""

from __future__ import annotations

import pytest

from adapter.training.arguments import ArgumentError, parse_args, validate_args

BASE = ["--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "1", "--lr", "1e-3", "--mock-data"]
TINY = ["--model", "qwen2.5-tiny", *BASE]
# architecture arguments without a named model (the NullTokenizer's vocabulary)
BARE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
        "--seq-length", "32", "--vocab-size", "256", *BASE]

MOE = ["--model", "qwen3-moe-tiny", *BASE]
# (arguments, world size, the message's start)
REFUSED = [
    (["--model", "qwen9-huge", *BASE], 2, "--model qwen9-huge: unknown model 'qwen9-huge': known models are"),
    ([*BARE, "--tensor-model-parallel-size", "0"], 2, "--tensor-model-parallel-size 0: must be positive"),
    ([*TINY, "--pipeline-model-parallel-size", "-1"], 2, "--pipeline-model-parallel-size -1: must be positive"),
    ([*TINY, "--micro-batch-size", "0"], 2, "--micro-batch-size 0: must be positive"),
    ([*TINY, "--hidden-size", "0"], 2, "--hidden-size 0: must be positive"),
    ([*BARE, "--seq-length", "-32"], 2, "--seq-length -32: must be positive"),
    ([*TINY, "--lr", "-1"], 2, "--lr -1.0: must be zero or more"),
    ([*TINY, "--eval-interval", "0"], 2, "--eval-interval 0: must be positive"),
    ([*TINY, "--vocab-size", "100000"], 2, "the tokenizer has 100001 entries, more than the 512 embedding rows"),
    ([*TINY, "--global-batch-size", "6"], 2,
     "global batch 6 is not divisible by micro batch 2 x data-parallel size 2"),
    ([*TINY, "--tensor-model-parallel-size", "3"], 6, "tensor parallel size 3 does not divide num_attention_heads=4"),
    ([*TINY, "--tensor-model-parallel-size", "2"], 3,
     "world size 3 is not divisible by tensor (2) x pipeline (1) x context (1) parallel = 2. Launch a multiple of 2"),
    ([*TINY, "--bf16", "--fp16"], 2, "--bf16 and --fp16 together"),
    ([*TINY, "--overlap-param-gather"], 2, "--overlap-param-gather needs --use-distributed-optimizer"),
    ([*TINY, "--data-path", "x"], 2, "give exactly one of --data-path and --mock-data"),
    (["--model", "qwen2.5-tiny", *BASE[:-1], "--data-path", "/no/such/corpus"], 2,
     "--data-path /no/such/corpus: /no/such/corpus.bin and /no/such/corpus.idx not found"),
    ([*TINY, "--num-layers-per-virtual-pipeline-stage", "3", "--pipeline-model-parallel-size", "2"], 2,
     "4 layers over PP 2 cannot be cut into virtual stages of 3 layers"),
    ([*TINY, "--context-parallel-size", "2"], 2,
     "--attention-dropout 0.1 with --context-parallel-size 2: the CP attention has no attention dropout"),
    ([*TINY, "--save-interval", "5"], 2, "--save-interval needs --save"),
    ([*TINY, "--lr-warmup-iters", "1"], 2, "--lr-warmup-iters 1: must be fewer than the 1 decay iterations"),
    ([*TINY, "--train-iters", "0"], 2, "--train-iters 0 without --lr-decay-iters: the LR schedule needs"),
    ([*TINY, "--tokenizer-type", "GPTSentencePieceTokenizer"], 2,
     "--tokenizer-type GPTSentencePieceTokenizer needs --tokenizer-model"),
    ([*TINY, "--kv-channels", "0"], 2, "--kv-channels 0: must be positive"),
    ([*BARE, "--num-attention-heads", "3"], 2, "hidden_size=64 is not divisible by num_attention_heads=3: set "
                                                "kv_channels"),
    ([*TINY, "--context-parallel-size", "2", "--cp-comm-type", "allgather"], 2,
     "--cp-comm-type allgather: not supported by the adapter's CP attention: use p2p or a2a"),
    ([*TINY, "--context-parallel-size", "2", "--cp-comm-type", "p2p", "a2a"], 2,
     "--cp-comm-type p2p a2a: one type for every layer is supported"),
    ([*TINY, "--context-parallel-size", "2", "--tensor-model-parallel-size", "2", "--cp-comm-type", "a2a"], 4,
     "--cp-comm-type a2a spreads each TP rank's 2 attention heads and 1 query groups over CP 2"),
    ([*TINY, "--context-parallel-size", "2", "--seq-length", "30"], 2,
     "seq_length=30 is not divisible by 2 x context parallel size 2 = 4 (megatron's load-balanced split"),
    ([*BARE, "--seq-length", "36", "--tensor-model-parallel-size", "4", "--context-parallel-size", "2",
      "--sequence-parallel"], 8, "sequence parallelism splits each CP rank's 18 tokens over TP 4"),
    ([*TINY, "--context-parallel-size", "2", "--attention-dropout", "0", "--reset-attention-mask"], 2,
     "--reset-attention-mask with --context-parallel-size 2: the CP attention is causal"),
    ([*TINY, "--exit-signal-handler", "--exit-signal", "SIGFOO"], 2,
     "--exit-signal SIGFOO: not a signal a process can catch; give its name, e.g. SIGTERM"),
    ([*TINY, "--exit-signal", "SIGKILL"], 2, "--exit-signal SIGKILL: not a signal a process can catch"),
    ([*TINY, "--exit-duration-in-mins", "0"], 2, "--exit-duration-in-mins 0.0: must be positive"),
    ([*TINY, "--error-injection-rate", "-1"], 2, "--error-injection-rate -1: must be zero or more"),
    ([*TINY, "--manual-gc", "--manual-gc-interval", "-1"], 2, "--manual-gc-interval -1: must be zero or more"),
    ([*TINY, "--moe-router-num-groups", "2", "--moe-router-group-topk", "1"], 2,
     "--moe-router-group-topk, --moe-router-num-groups for a dense model: pass --num-experts N"),
    ([*TINY, "--decoder-first-pipeline-num-layers", "1"], 2,
     "an uneven pipeline split (--decoder-first/last-pipeline-num-layers, --account-for-*-in-pipeline-split) needs"),
    ([*TINY, "--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "3",
      "--decoder-last-pipeline-num-layers", "2"], 2,
     "4 layers over pipeline 2 x virtual pipeline 1 with first stage 3 and last stage 2 layers: the -1 other"),
    ([*TINY, "--pipeline-model-parallel-size", "2", "--account-for-embedding-in-pipeline-split"], 2,
     "4 layers + 1 (embedding / loss) = 5 cannot be split evenly over pipeline (2) x virtual pipeline (1)"),
    ([*TINY, "--pipeline-model-parallel-size", "2", "--account-for-embedding-in-pipeline-split",
      "--decoder-last-pipeline-num-layers", "2"], 2, "the first / last pipeline stage's layer counts and the"),
    ([*TINY, "--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "1",
      "--num-layers-per-virtual-pipeline-stage", "1"], 2,
     "--num-layers-per-virtual-pipeline-stage with an uneven pipeline split"),
    ([*BARE, "--multi-latent-attention", "--disable-bias-linear", "--context-parallel-size", "2",
      "--attention-dropout", "0"], 2,
     "--context-parallel-size 2 --cp-comm-type p2p with multi-latent attention's key heads of 192 and value heads "
     "of 128: the adapter's ring attention"),
    ([*BARE, "--multi-latent-attention", "--add-qkv-bias"], 2,
     "multi_latent_attention with add_qkv_bias=True: megatron's MLA is a GPT stack's attention"),
    ([*MOE, "--moe-router-num-groups", "4"], 2, "--moe-router-num-groups and --moe-router-group-topk go together"),
    ([*MOE, "--moe-router-num-groups", "3", "--moe-router-group-topk", "1"], 2,
     "--moe-router-num-groups 3 does not divide the 8 experts"),
    ([*MOE, "--moe-router-num-groups", "4", "--moe-router-group-topk", "3"], 2,
     "--moe-router-group-topk 3: must be at most --moe-router-num-groups 4 and divide --moe-router-topk 2"),
]


def assert_refused(argv: list[str], world: int, message: str) -> None:
    """``validate_args`` refuses ``argv`` at ``world`` ranks with one error starting with ``message``."""
    with pytest.raises(ArgumentError) as refused:
        validate_args(parse_args(argv), world)
    assert str(refused.value).startswith(message)


@pytest.mark.parametrize("argv, world, message", REFUSED, ids=[m[:40] for _, _, m in REFUSED])
def test_each_refusal_names_the_value_and_the_fix(argv, world, message):
    assert_refused(argv, world, message)


def test_megatron_lm_training_flags_reach_megatrons_config_with_their_meanings():
    """What transformer_config_overrides hands the model provider: Megatron-LM's TransformerConfig fields of
    the same names; transformer_engine is Megatron-LM's default spelling of the spec, accepted."""
    from adapter.training.pretrain import transformer_config_overrides

    args = validate_args(parse_args([*TINY, "--recompute-granularity", "selective", "--recompute-modules",
                                     "core_attn", "mlp", "--calculate-per-token-loss", "--transformer-impl",
                                     "transformer_engine"]), 2)
    overrides = transformer_config_overrides(args)
    assert (overrides["recompute_granularity"], overrides["recompute_modules"]) == ("selective", ["core_attn", "mlp"])
    assert overrides["calculate_per_token_loss"] and args.transformer_impl == "transformer_engine"
    assert "recompute_modules" not in transformer_config_overrides(validate_args(parse_args(
        [*TINY, "--recompute-granularity", "selective"]), 2))  # megatron's default, core_attn
    args = validate_args(parse_args([*MOE, "--moe-router-num-groups", "4", "--moe-router-group-topk", "2"]), 2)
    overrides = transformer_config_overrides(args)
    assert (overrides["moe_router_num_groups"], overrides["moe_router_group_topk"]) == (4, 2)
    args = validate_args(parse_args(TINY), 2)
    assert (args.manual_gc, args.manual_gc_interval, args.manual_gc_eval, args.calculate_per_token_loss) == (
        False, 0, True, False)


def test_a_named_qwen3_carries_its_head_size_and_qk_norm_and_kv_channels_sets_one():
    """Qwen3's heads are not hidden / heads wide (qwen3-tiny: 4 of 32 in a hidden size of 64); Megatron-LM's
    --kv-channels sets the head size over a named model or bare arguments, as --qk-layernorm the QK-norm."""
    import models

    qwen3 = validate_args(parse_args(["--model", "qwen3-tiny", *BASE]), 2).model_config
    assert qwen3 == models.get("qwen3-tiny") and (qwen3.head_dim, qwen3.qk_layernorm) == (32, True)
    wider = validate_args(parse_args(["--model", "qwen2.5-tiny", *BASE, "--kv-channels", "32", "--qk-layernorm"]), 2)
    assert wider.model_config == models.get("qwen2.5-tiny", kv_channels=32, qk_layernorm=True)
    bare = validate_args(parse_args([*BARE, "--num-attention-heads", "3", "--kv-channels", "16"]), 2).model_config
    assert (bare.head_dim, bare.qk_layernorm) == (16, False)


def test_context_parallel_takes_its_ranks_from_data_parallel_and_one_comm_type():
    """CP ranks come out of the data-parallel ranks; one --cp-comm-type (or the same one per layer) is the
    string megatron's layers read, p2p by default as in Megatron-LM."""
    args = validate_args(parse_args([*TINY, "--context-parallel-size", "2", "--attention-dropout", "0"]), 4)
    assert (args.data_parallel_size, args.num_micro_batches, args.cp_comm_type) == (2, 2, "p2p")
    args = validate_args(parse_args([*TINY, "--context-parallel-size", "2", "--attention-dropout", "0",
                                     "--cp-comm-type", *["a2a"] * 4]), 2)
    assert args.cp_comm_type == "a2a"
    mla = validate_args(parse_args([*BARE, "--multi-latent-attention", "--disable-bias-linear",
                                    "--context-parallel-size", "2", "--attention-dropout", "0", "--cp-comm-type",
                                    "a2a"]), 2)
    assert mla.model_config.multi_latent_attention and mla.cp_comm_type == "a2a"  # Ulysses takes MLA's head sizes


def test_the_resilience_arguments_keep_megatron_lms_names_and_defaults():
    import signal

    args = validate_args(parse_args(TINY), 2)
    assert (args.exit_signal_handler, args.exit_signal, args.exit_duration_in_mins) == (False, signal.SIGTERM, None)
    assert (args.check_for_nan_in_loss_and_grad, args.check_for_spiky_loss, args.rerun_mode) == (
        True, False, "validate_results")
    args = validate_args(parse_args([*TINY, "--exit-signal", "SIGUSR1", "--no-check-for-nan-in-loss-and-grad"]), 2)
    assert (args.exit_signal, args.check_for_nan_in_loss_and_grad) == (signal.SIGUSR1, False)
    # as Megatron-LM: fp16's dynamic loss scaling reads NaN gradients as its cue to skip a step
    assert not validate_args(parse_args([*TINY, "--fp16"]), 2).check_for_nan_in_loss_and_grad
    assert validate_args(parse_args([*TINY, "--fp16", "--loss-scale", "1024"]), 2).check_for_nan_in_loss_and_grad


def test_report_stats_is_refused_where_megatrons_machine_cannot_report_them():
    from adapter.training.arguments import _reports_stats

    if _reports_stats():
        assert validate_args(parse_args([*TINY, "--rerun-mode", "report_stats"]), 2).rerun_mode == "report_stats"
    else:
        assert_refused([*TINY, "--rerun-mode", "report_stats"], 2, "--rerun-mode report_stats: this megatron-core's")


def test_num_micro_batches_is_global_over_micro_times_dp():
    args = validate_args(parse_args([*TINY, "--global-batch-size", "16"]), 4)
    assert (args.data_parallel_size, args.num_micro_batches) == (4, 2)


def test_a_tracker_naming_a_missing_iteration_is_refused_naming_the_newest_complete_one(tmp_path):
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("20")
    complete = tmp_path / "iter_0000010"
    complete.mkdir()
    (complete / "metadata.json").write_text("{}")
    (complete / ".metadata").write_bytes(b"")
    (tmp_path / "iter_0000015").mkdir()  # a checkpoint whose save never finished
    with pytest.raises(ArgumentError) as refused:
        validate_args(parse_args([*TINY, "--load", str(tmp_path)]), 2)
    assert str(refused.value) == (
        f"--load {tmp_path}: latest_checkpointed_iteration.txt names {tmp_path / 'iter_0000020'}, which is missing; "
        "the newest complete checkpoint there is iter_0000010: write 10 into latest_checkpointed_iteration.txt "
        "to resume from it")


def refused_line(argv: list[str], capsys) -> str:
    """The one stderr line ``parse_args`` refuses ``argv`` with (exit status 2, no usage)."""
    with pytest.raises(SystemExit) as stopped:
        parse_args(argv)
    err = capsys.readouterr().err.strip()
    assert stopped.value.code == 2 and len(err.splitlines()) == 1 and "usage:" not in err, err
    assert err.startswith("error: ")
    return err.removeprefix("error: ")


def _megatron_lm_parser():
    from adapter.training.megatron_lm_flags import megatron_lm_parser

    parser = megatron_lm_parser()
    if parser is None:
        pytest.skip("megatron.training (Megatron-LM's parser) is not importable")
    return parser


def test_megatron_lm_flags_the_flow_lacks_are_refused_in_one_line_naming_adapter_run(capsys):
    """The flags come from Megatron-LM's own parser: any of its options this flow lacks (not a CUDA library's)
    is refused in one line naming the flag and ``-m adapter.run``."""
    from adapter import cuda_only_features
    from adapter.training.arguments import build_parser

    ours = set(build_parser()._option_string_actions)
    cuda_only = {setting for feature in cuda_only_features.FEATURES for setting in feature.settings}
    theirs = _megatron_lm_parser()._option_string_actions
    switches = sorted(flag for flag, action in theirs.items() if flag.startswith("--") and flag not in ours
                      and action.nargs == 0 and action.dest not in cuda_only)
    assert len(switches) > 100 and ("--tp-comm-overlap" in switches or "tp_comm_overlap" in cuda_only)
    for flag in switches:
        line = refused_line([*TINY, flag], capsys)
        assert line.startswith(f"{flag}: Megatron-LM's flag") and "-m adapter.run" in line, line
    line = refused_line([*TINY, "--lr-decay-samples", "10", "--log-params-norm"], capsys)
    assert line.startswith("--lr-decay-samples --log-params-norm: Megatron-LM's flags"), line
    # a value only Megatron-LM's flag takes
    line = refused_line([*TINY, "--ckpt-format", "torch"], capsys)
    assert line.startswith("--ckpt-format torch: Megatron-LM's value") and "-m adapter.run" in line, line


def test_cuda_library_flags_get_the_cuda_only_refusal_megatron_lms_flow_gives(capsys):
    """Off CUDA, a flag turning on a feature of ``cuda_only_features.FEATURES`` is refused with that
    feature's ``refusal()`` text, whatever the flow."""
    import adapter
    from adapter import cuda_only_features

    if adapter.current_backend().name == "cuda":
        pytest.skip("on CUDA these are megatron's own features")
    _megatron_lm_parser()
    features = {name: feature for feature in cuda_only_features.FEATURES for name in feature.settings}
    for given, dest in ((["--fp8-format", "hybrid"], "fp8"), (["--cuda-graph-impl", "local"], "cuda_graph_impl"),
                        (["--use-nccl-ub"], "nccl_ub"), (["--symmetric-ar-type", "two_shot"], "symmetric_ar_type")):
        line = refused_line([*TINY, *given], capsys)
        assert line == str(cuda_only_features.refusal(features[dest], " ".join(given))), line


def test_a_flag_no_parser_knows_keeps_argparses_error(capsys):
    _megatron_lm_parser()
    for extra in (["--no-such-flag"], ["--manual-gc", "--no-such-flag"]):
        with pytest.raises(SystemExit) as stopped:
            parse_args([*TINY, *extra])
        err = capsys.readouterr().err
        assert stopped.value.code == 2 and "usage:" in err and "unrecognized arguments: " in err, err

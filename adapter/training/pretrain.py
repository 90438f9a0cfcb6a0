"""``pretrain``: Megatron-LM's four steps on megatron-core, through the device adapter.

1. initialize: arguments (Megatron-LM's names), tokenizer, the adapter's process group (gloo / NCCL /
   HCCL), megatron's model-parallel groups, seeds, the micro-batch calculator;
2. model (one chunk per virtual pipeline stage, wrapped in megatron-core's DDP, Megatron-FSDP or FSDP2), optimizer
   (``get_megatron_optimizer``, distributed when asked) and ``OptimizerParamScheduler``; ``--load``;
3. train / valid / test data iterators from the dataset provider;
4. train by iterations (``train_step``: zero grads, ``forward_backward_func``, optimizer step, scheduler
   step), evaluating every ``--eval-interval`` and saving every ``--save-interval``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random

import numpy as np
import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.enums import ModelType
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker
from megatron.core.transformer.transformer_layer import TransformerLayer

import adapter
from adapter import early_exit, liveness
from adapter.kernels import cuda_provider
from adapter.training import checkpointing, global_vars, nonfinite, offloading
from adapter.training.manual_gc import ManualGC
from adapter.training.arguments import ArgumentError, fit_vocab, parse_args, refuse, validate_args
from adapter.training.preemption import Preemption
from adapter.training.training_log import StartupClock, TrainingLog


def initialize(extra_args_provider=None, args_defaults: dict | None = None, argv=None):
    """Parse and check the arguments, build the tokenizer, start the groups; returns the arguments.
    Arguments that cannot run stop every rank here, before any process group exists (``refuse``)."""
    from adapter.training.tokenizer import build_tokenizer

    args = parse_args(argv, extra_args_provider, args_defaults)
    try:
        validate_args(args, int(os.environ.get("WORLD_SIZE", "1")))
        try:
            tokenizer = build_tokenizer(args)
        except ValueError as exc:  # a tokenizer type or model file that does not work
            raise ArgumentError(str(exc)) from exc
        fit_vocab(args, tokenizer.vocab_size)
    except ArgumentError as exc:
        refuse(exc)
    global_vars.set_args(args)
    global_vars.set_tokenizer(tokenizer)

    adapter.init_distributed(timeout=args.distributed_timeout_minutes)
    liveness.watch(args.distributed_timeout_minutes)  # a hung collective ends the job, saying where
    if torch.distributed.get_rank() == 0:  # what runs in place of megatron's silenced fallback warnings
        from adapter.report import kernel_summary

        print(kernel_summary(), flush=True)
        _say_transformer_impl(args)
    parallel_state.initialize_model_parallel(
        args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
        args.virtual_pipeline_model_parallel_size, context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        distributed_timeout_minutes=args.distributed_timeout_minutes)
    init_num_microbatches_calculator(torch.distributed.get_rank(), None, args.global_batch_size,
                                     args.micro_batch_size, args.data_parallel_size)
    # as Megatron-LM: pipeline stages draw different streams, data-parallel replicas the same
    seed = args.seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    if args.save:
        checkpointing.recover_interrupted_save(args)
    offloading.start(args)
    return args


def _say_transformer_impl(args) -> None:
    """``--transformer-impl transformer_engine`` (Megatron-LM's default) without Transformer Engine: the
    adapter's layer spec runs, as with ``local``, and rank 0 says so once. Where TE is importable the CUDA
    provider's kernels are TE's, so the spelling means what it says."""
    if args.transformer_impl == "transformer_engine" and not cuda_provider.HAVE_TE:
        print("[adapter] --transformer-impl transformer_engine: Transformer Engine is not importable here; the "
              "adapter's layer spec runs with the kernel provider's kernels (as --transformer-impl local)", flush=True)


def transformer_config_overrides(args) -> dict:
    """TransformerConfig fields from the arguments: what a model provider passes on
    (``models.provider.make_model_provider(args.model_config, **transformer_config_overrides(args))``)."""
    recompute = {}
    if args.recompute_granularity:
        recompute = dict(recompute_granularity=args.recompute_granularity, recompute_method=args.recompute_method,
                         recompute_num_layers=args.recompute_num_layers or
                         (1 if args.recompute_method == "uniform" else None))
        if args.recompute_modules:
            recompute["recompute_modules"] = args.recompute_modules
    return dict(
        params_dtype=args.params_dtype, pipeline_dtype=args.params_dtype, bf16=args.bf16, fp16=args.fp16,
        sequence_parallel=args.sequence_parallel, hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout, init_method_std=args.init_method_std,
        masked_softmax_fusion=args.masked_softmax_fusion, bias_activation_fusion=args.bias_swiglu_fusion,
        apply_rope_fusion=args.apply_rope_fusion, cross_entropy_loss_fusion=args.cross_entropy_loss_fusion,
        gradient_accumulation_fusion=args.gradient_accumulation_fusion,
        attention_softmax_in_fp32=True, use_cpu_initialization=not adapter.device.has_accelerator(),
        deallocate_pipeline_outputs=True, context_parallel_size=args.context_parallel_size,
        cp_comm_type=args.cp_comm_type, calculate_per_token_loss=args.calculate_per_token_loss,
        num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers,
        account_for_embedding_in_pipeline_split=args.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=args.account_for_loss_in_pipeline_split,
        **recompute, **_moe_overrides(args), **_mtp_overrides(args), **offloading.transformer_fields(args))


def _mtp_overrides(args) -> dict:
    """The weight of the MTP loss (Megatron-LM's --mtp-loss-scaling-factor); nothing without MTP layers."""
    if args.model_config.mtp_num_layers is None:
        return {}
    return {"mtp_loss_scaling_factor": args.mtp_loss_scaling_factor}


# Megatron-LM's MoE training arguments that are TransformerConfig fields of the same name and meaning.
MOE_TRAINING_FIELDS = (
    "expert_model_parallel_size", "expert_tensor_parallel_size", "moe_grouped_gemm", "moe_token_dispatcher_type",
    "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_shared_expert_overlap",
    "moe_permute_fusion", "moe_router_bias_update_rate", "moe_expert_capacity_factor",
    "moe_pad_expert_input_to_capacity", "moe_token_drop_policy", "moe_router_dtype", "moe_per_layer_logging",
    "moe_router_num_groups", "moe_router_group_topk")


def _moe_overrides(args) -> dict:
    """How a MoE model trains (the experts themselves are the ModelConfig's); nothing for a dense model."""
    if args.model_config.num_experts is None:
        return {}
    return {name: getattr(args, name) for name in MOE_TRAINING_FIELDS}


def setup_model_and_optimizer(model_provider, model_type=ModelType.encoder_or_decoder):
    """Model chunks (wrapped for data parallelism), optimizer and LR scheduler for the arguments."""
    args = global_vars.get_args()
    if model_type != ModelType.encoder_or_decoder:
        raise ArgumentError(f"model type {model_type}: this flow trains decoder-only models")
    vpp = args.virtual_pipeline_model_parallel_size
    stages = [None] if vpp is None else list(range(vpp))
    chunks = [model_provider(pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=s),
                             post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=s),
                             vp_stage=s) for s in stages]
    # as Megatron-LM's get_model: modules built without a device (torch's norms, the kernel provider's)
    # start on the CPU whatever use_cpu_initialization says, so each chunk goes to this rank's device
    chunks = [chunk.to(adapter.device.torch_device()) for chunk in chunks]
    chunks = _wrap_for_data_parallel(args, chunks)
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer=args.optimizer, lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        sgd_momentum=args.sgd_momentum, clip_grad=args.clip_grad, bf16=args.bf16, fp16=args.fp16,
        params_dtype=args.params_dtype, loss_scale=args.loss_scale, initial_loss_scale=args.initial_loss_scale,
        min_loss_scale=args.min_loss_scale, loss_scale_window=args.loss_scale_window, hysteresis=args.hysteresis,
        use_distributed_optimizer=args.use_distributed_optimizer,
        overlap_param_gather=args.overlap_param_gather, **offloading.optimizer_fields(args)), chunks)
    for chunk_config in {id(c.config): c.config for c in chunks}.values():
        # no_sync only with --overlap-grad-reduce, as Megatron-LM's train(): without overlap megatron reduces once,
        # after backward; Megatron-FSDP's hooks would reduce again where no_sync marks the last micro-batch (twice
        # in place: ``optim``'s gradients went wrong)
        if args.overlap_grad_reduce:
            chunk_config.no_sync_func = [c.no_sync for c in chunks] if len(chunks) > 1 else chunks[0].no_sync
        chunk_config.finalize_model_grads_func = finalize_model_grads
        chunk_config.grad_scale_func = optimizer.scale_loss
        if args.overlap_param_gather:
            chunk_config.param_sync_func = ([c.start_param_sync for c in chunks] if len(chunks) > 1
                                            else chunks[0].start_param_sync)
    samples = args.global_batch_size
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * samples, lr_decay_steps=args.lr_decay_iters * samples,
        lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay, end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters * samples, wd_incr_style="constant")
    return chunks, optimizer, scheduler


# The modules FSDP2 shards one at a time (all-gathered just in time): megatron's default set less
# ColumnParallelLinear, as megatron takes it for the local layer spec, which the adapter's spec is (the
# layers' linears are inside their TransformerLayer's unit already).
FSDP2_UNITS = {TransformerLayer, LanguageModelEmbedding, RotaryEmbedding}


def _wrap_for_data_parallel(args, chunks: list) -> list:
    """Each chunk in megatron's data-parallel wrapper, as Megatron-LM's get_model picks it: torch FSDP2
    (``TorchFullyShardedDataParallel``, --use-torch-fsdp2), Megatron-FSDP (``FullyShardedDataParallel``,
    --use-megatron-fsdp, sharding what --data-parallel-sharding-strategy says), else DDP."""
    config = chunks[0].config
    if args.use_torch_fsdp2:
        from megatron.core.distributed import TorchFullyShardedDataParallel, TorchFullyShardedDataParallelConfig

        fsdp2 = TorchFullyShardedDataParallelConfig(reshard_after_forward=args.torch_fsdp2_reshard_after_forward)
        return [TorchFullyShardedDataParallel(config, fsdp2, chunk, sub_modules_to_wrap=FSDP2_UNITS)
                for chunk in chunks]
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32 or args.params_dtype != torch.float32,
        overlap_grad_reduce=args.overlap_grad_reduce, overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer, bucket_size=args.ddp_bucket_size,
        check_for_nan_in_grad=args.check_for_nan_in_loss_and_grad, use_megatron_fsdp=args.use_megatron_fsdp,
        data_parallel_sharding_strategy=args.data_parallel_sharding_strategy if args.use_megatron_fsdp else "no_shard")
    wrapper = DistributedDataParallel
    if args.use_megatron_fsdp:  # imports einops, which the arguments' check found
        from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel as wrapper
    return [wrapper(config, ddp_config, chunk, disable_bucketing=i > 0) for i, chunk in enumerate(chunks)]


def over_context_parallel(forward_step_func):
    """``forward_step_func`` whose loss function's (sum, count, report) becomes, under context
    parallelism, (CP x this rank's sum, the token count of the whole sequence): megatron's schedule
    divides the first by the second, and its DDP averages gradients over DP x CP, so each CP rank's
    tokens weigh as in the unsplit sequence even where the ranks hold different numbers of unmasked
    tokens (--eod-mask-loss; earlier Megatron-LM pretrain_gpt.py all-reduced the [sum, count] pair over
    the CP group for the same reason, today's weighs each rank's mean alike). The report stays this rank's
    own pair, reduced over DP x CP where it is logged. A forward step's loss function therefore returns
    local sums (adapter.training.gpt_step's does); a two-value (mean) loss is megatron's to scale."""
    if parallel_state.get_context_parallel_world_size() == 1:
        return forward_step_func

    def forward_step(data_iterator, model, *args):
        output, loss_func = forward_step_func(data_iterator, model, *args)
        return output, functools.partial(_context_parallel_loss, loss_func)

    return forward_step


def _context_parallel_loss(loss_func, output_tensor):
    outputs = loss_func(output_tensor)
    if len(outputs) != 3:
        return outputs
    total, count, report = outputs
    whole = count.detach().clone()
    torch.distributed.all_reduce(whole, group=parallel_state.get_context_parallel_group())
    return total * parallel_state.get_context_parallel_world_size(), whole, report


def _reduced_losses(losses: list[dict]) -> dict[str, torch.Tensor]:
    """Mean of each logged loss over the micro-batches of this rank, then over data-parallel ranks (and
    context-parallel ones, which each hold part of every sequence). A loss given as [sum, count]
    (Megatron-LM's per-token form) is summed before dividing. Left on the device: the log reads it."""
    if not losses or not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return {}
    out = {}
    for name in losses[0]:
        values = torch.stack([entry[name].float().reshape(-1) for entry in losses])
        pair = values.shape[-1] == 2
        total = values.sum(dim=0) if pair else torch.stack([values.mean(), values.new_ones(())])
        torch.distributed.all_reduce(total, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        out[name] = total[0] / total[1]
    return out


def train_step(forward_step_func, data_iterator, model: list, optimizer, scheduler):
    """One iteration: returns (losses on the last stage, skipped?, grad norm). The forward and backward
    run again where megatron's rerun state machine asks (``nonfinite``), which stops every rank before
    the optimizer step where a rejected result says so."""
    args = global_vars.get_args()

    def forward_backward():
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        return get_forward_backward_func()(
            forward_step_func=over_context_parallel(forward_step_func), data_iterator=data_iterator,
            model=model if len(model) > 1 else model[0], num_microbatches=args.num_micro_batches,
            seq_length=args.seq_length, micro_batch_size=args.micro_batch_size, forward_only=False)

    losses = nonfinite.forward_backward(forward_backward, data_iterator)
    succeeded, grad_norm, _ = optimizer.step()
    nonfinite.check_grad_norm(grad_norm)
    if succeeded:
        scheduler.step(increment=args.global_batch_size)
    return _reduced_losses(losses), not succeeded, grad_norm


@contextlib.contextmanager
def parameters_synced(model: list):
    """Every rank's model holds all the trained parameters in the block. With --overlap-param-gather the
    all-gather of what a step updated is deferred into the next step's forward (its pre-hooks wait for
    it), so after a step each data-parallel rank is fresh only in its own shard: evaluation and saves
    need every shard now. As Megatron-LM does: the hooks come off with a synchronous all-gather, and go
    back on after. Megatron-FSDP gathers what each forward needs itself (Megatron-LM leaves its hooks on)."""
    args = global_vars.get_args()
    if not (args.use_distributed_optimizer and args.overlap_param_gather) or args.use_megatron_fsdp:
        yield
        return
    for chunk in model:
        chunk.disable_forward_pre_hook(param_sync=True)
    try:
        yield
    finally:
        for chunk in model:
            chunk.enable_forward_pre_hook()


def evaluate(forward_step_func, data_iterator, model: list, eval_iters: int) -> dict:
    """Mean losses over ``eval_iters`` global batches, without gradients."""
    args = global_vars.get_args()
    for chunk in model:
        chunk.eval()
    totals: dict[str, float] = {}
    with torch.no_grad(), nonfinite.validation_off():
        for _ in range(eval_iters):
            losses = get_forward_backward_func()(
                forward_step_func=over_context_parallel(forward_step_func), data_iterator=data_iterator,
                model=model if len(model) > 1 else model[0], num_microbatches=args.num_micro_batches,
                seq_length=args.seq_length, micro_batch_size=args.micro_batch_size, forward_only=True)
            for name, value in _reduced_losses(losses).items():
                totals[name] = totals.get(name, 0.0) + value.item() / eval_iters
    for chunk in model:
        chunk.train()
    if args.model_config.num_experts is not None:
        clear_aux_losses_tracker()  # as Megatron-LM: the next iteration's router losses are training's alone
    return totals


def build_train_valid_test_data_iterators(dataset_provider, consumed: dict) -> tuple[tuple, list[bool]]:
    """(train, valid, test) iterators from ``dataset_provider([train, valid, test samples])``, resuming
    after the consumed samples; one iterator per model chunk under the interleaved schedule, since each
    virtual stage draws its own micro-batches; None on ranks that read no data. Also returns, per
    split, whether it has data on any rank."""
    from adapter.training.data import build_pretraining_data_loader

    args = global_vars.get_args()
    evaluations = args.train_iters // args.eval_interval + 1 if args.eval_iters else 0
    samples = [args.train_iters * args.global_batch_size, evaluations * args.eval_iters * args.global_batch_size,
               args.eval_iters * args.global_batch_size]
    try:
        datasets = dataset_provider(samples)
    except (ValueError, FileNotFoundError) as exc:  # --data-path that does not hold the data
        raise ArgumentError(f"the datasets could not be built: {exc}") from exc
    starts = (consumed["train"], consumed["valid"], 0)
    copies = args.virtual_pipeline_model_parallel_size or 1

    def iterators(dataset, start):
        if dataset is None or len(dataset) == 0:
            return None
        made = [iter(build_pretraining_data_loader(dataset, start, args)) for _ in range(copies)]
        return made if copies > 1 else made[0]

    # Ranks that read no data (not TP rank 0, or a middle stage) get no datasets; whether the valid
    # and test splits have data is decided for all ranks together, so all run the same evaluations.
    present = torch.tensor([int(d is not None and len(d) > 0) for d in datasets],
                           device=adapter.device.torch_device())  # NCCL and HCCL reduce device tensors only
    torch.distributed.all_reduce(present, op=torch.distributed.ReduceOp.MAX)
    return tuple(iterators(d, start) for d, start in zip(datasets, starts)), [bool(p) for p in present.tolist()]


def _say_stopped(iteration: int, reason: str, save: str | None) -> None:
    """Rank 0's line for a run that left early (``Preemption``); the test evaluation is skipped, as in
    Megatron-LM: the time left is the scheduler's."""
    if torch.distributed.get_rank() == 0:
        print(early_exit.stopped_line(iteration, reason, save), flush=True)


def pretrain(train_valid_test_dataset_provider, model_provider, model_type, forward_step_func,
             process_non_loss_data_func=None, extra_args_provider=None, args_defaults: dict | None = None,
             argv=None) -> dict:
    """Megatron-LM's ``pretrain``; returns what was logged (losses per log line, validation losses).
    ``process_non_loss_data_func`` is accepted for Megatron-LM's signature; nothing here produces non-loss
    data to hand it."""
    clock = StartupClock()
    args = initialize(extra_args_provider, args_defaults, argv)
    clock.mark("initialize")
    model, optimizer, scheduler = setup_model_and_optimizer(model_provider, model_type)
    clock.mark("model and optimizer")
    iteration, consumed = 0, {"train": 0, "valid": 0}
    if args.load:
        iteration, consumed = checkpointing.load_checkpoint(args, model, optimizer, scheduler)
        clock.mark("checkpoint load")
    (train_iter, valid_iter, test_iter), (_, do_valid, do_test) = build_train_valid_test_data_iterators(
        train_valid_test_dataset_provider, consumed)
    nonfinite.initialize(args, iteration)
    train_iter = nonfinite.replayable(train_iter)
    clock.mark("data")
    log = TrainingLog(args, model)
    straggler = liveness.StragglerCheck(args.log_interval)
    history = {"train": [], "validation": [], "iteration": iteration}
    for chunk in model:
        chunk.train()
    preemption, stopped, collector = Preemption(args), None, ManualGC(args)
    while iteration < args.train_iters:
        losses, skipped, grad_norm = train_step(forward_step_func, train_iter, model, optimizer, scheduler)
        if clock is not None:
            clock.mark("first iteration")
            history["startup"] = log.started(clock)
            clock = None
        iteration += 1
        consumed["train"] += args.global_batch_size
        log.add(losses, skipped)
        logged = log.step(iteration, consumed["train"], scheduler.get_lr(optimizer.param_groups[0]),
                          optimizer.get_loss_scale(), grad_norm)
        if logged:
            history["train"].append(logged)
        straggler.step(iteration)
        collector.step(iteration)
        if do_valid and args.eval_iters and iteration % args.eval_interval == 0:
            with log.excluded(), parameters_synced(model), collector.evaluation():
                valid = evaluate(forward_step_func, valid_iter, model, args.eval_iters)
            consumed["valid"] += args.eval_iters * args.global_batch_size
            log.validation(iteration, valid)
            history["validation"].append({"iteration": iteration, **valid})
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            with log.excluded(), parameters_synced(model):
                checkpointing.save_checkpoint(args, iteration, model, optimizer, scheduler, consumed)
        if args.async_save:
            checkpointing.finalize_async_saves()  # publishes what every rank has written
        stopped = preemption.stop_reason()
        if stopped or (args.exit_interval and iteration % args.exit_interval == 0):
            break
    with parameters_synced(model):
        if args.save and (not args.save_interval or iteration % args.save_interval):
            checkpointing.save_checkpoint(args, iteration, model, optimizer, scheduler, consumed)
        if args.async_save:
            checkpointing.finalize_async_saves(blocking=True)
        if stopped:
            _say_stopped(iteration, stopped, args.save)
        elif do_test and args.eval_iters:
            test = evaluate(forward_step_func, test_iter, model, args.eval_iters)
            log.validation(iteration, test, label="test")
            history["test"] = test
    preemption.close()  # after the last save: a signal during it is only noted
    collector.close()
    log.close()
    history.update(iteration=iteration, stopped=stopped)
    torch.distributed.barrier()
    return history

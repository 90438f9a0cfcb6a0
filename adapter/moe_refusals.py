"""Mixture-of-experts settings megatron.training takes without a check of its own, each refused in one line
naming the flag, the value and the fix. Taken, each fails later with a traceback on every rank (a shape as the
experts are built or split, a router's top-k over too few experts, a layer pattern indexed past its end), or
trains something other than what was asked (a flag of an MoE layer on a dense model, a negative auxiliary
loss). patches/input_refusals.py runs ``check_before`` ahead of megatron's ``validate_args`` and ``check``
after it, where megatron has filled in what it derives (the expert tensor-parallel size, the world size).
"""

from __future__ import annotations

from adapter.input_refusals import InputRefused, as_given, flag_default

# flags that only an MoE layer reads: given for a dense model (no --num-experts) they do nothing
_MOE_ONLY = ("moe_router_topk", "moe_aux_loss_coeff", "moe_grouped_gemm", "moe_shared_expert_intermediate_size",
             "moe_router_topk_scaling_factor")


def check_before(args) -> None:
    """What megatron's ``validate_args`` compares before any check of its own (the expert parallel sizes are
    ``input_refusals.check_sizes``')."""
    if getattr(args, "num_experts", None) is not None and args.num_experts < 0:
        raise InputRefused(f"{as_given('num_experts', args)}: must be zero or more (0 or unset: a dense model)")


def check(args) -> None:
    """The MoE settings of validated ``args``: those of a dense model, or the layout, routing, shared expert and
    layer pattern of a mixture of experts."""
    if not getattr(args, "num_experts", None):
        _dense(args)
        return
    _layout(args)
    _routing(args)
    _shared_expert(args)
    _layer_pattern(args)


def _given(name: str, args) -> bool:
    value, default = getattr(args, name, None), flag_default(name)
    return value not in (None, False, default, [default])


def _dense(args) -> None:
    given = [name for name in _MOE_ONLY if _given(name, args)]
    if given:
        raise InputRefused(f"{', '.join(as_given(name, args) for name in given)} for a dense model (no "
                           "--num-experts): they set a mixture of experts; pass --num-experts N, or leave them out")


def _layout(args) -> None:
    tp, etp, ep = args.tensor_model_parallel_size, args.expert_tensor_parallel_size, args.expert_model_parallel_size
    pp, world = args.pipeline_model_parallel_size, args.world_size
    if world % (etp * ep * pp):
        raise InputRefused(f"world size {world} is not divisible by expert tensor ({etp}) x expert ({ep}) x "
                           f"pipeline ({pp}) parallel = {etp * ep * pp}: launch a multiple of {etp * ep * pp} "
                           "ranks, or lower --expert-model-parallel-size")
    ffn = args.moe_ffn_hidden_size or args.ffn_hidden_size
    if ffn % etp:
        raise InputRefused(f"expert tensor parallel size {etp} does not divide the experts' FFN size {ffn} "
                           "(--moe-ffn-hidden-size): give --expert-tensor-parallel-size a divisor of it")
    if tp > 1 and not args.sequence_parallel:
        raise InputRefused(f"a MoE model at TP {tp} needs --sequence-parallel: megatron's token dispatchers "
                           "take each TP rank's part of the sequence; add --sequence-parallel")


def _routing(args) -> None:
    if args.moe_router_topk > args.num_experts:
        raise InputRefused(f"{as_given('moe_router_topk', args)} exceeds {as_given('num_experts', args)}: "
                           "each token goes to at most every expert; lower --moe-router-topk")
    scaling = getattr(args, "moe_router_topk_scaling_factor", None)
    if scaling is not None and scaling <= 0:
        raise InputRefused(f"{as_given('moe_router_topk_scaling_factor', args)}: must be positive (it scales "
                           "the routing weights; leave it unset for 1)")
    coefficients = args.moe_aux_loss_coeff if isinstance(args.moe_aux_loss_coeff, list) else [args.moe_aux_loss_coeff]
    if any(coefficient < 0 for coefficient in coefficients):
        raise InputRefused(f"{as_given('moe_aux_loss_coeff', args)}: must be zero or more (a negative "
                           "auxiliary loss rewards imbalance)")


def _shared_expert(args) -> None:
    if getattr(args, "moe_shared_expert_intermediate_size", None):
        return
    given = [name for name in ("moe_shared_expert_gate", "moe_shared_expert_overlap") if getattr(args, name, False)]
    if given:
        raise InputRefused(f"{', '.join(as_given(name, args) for name in given)} without a shared expert: "
                           "pass --moe-shared-expert-intermediate-size N, or leave them out")


def _layer_pattern(args) -> None:
    pattern = args.moe_layer_freq
    if isinstance(pattern, list) and (len(pattern) != args.num_layers or set(pattern) - {0, 1}):
        raise InputRefused(f"{as_given('moe_layer_freq', args)}: a pattern needs one 0 (dense) or 1 (MoE) per "
                           f"layer, {args.num_layers} in all")

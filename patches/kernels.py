"""Megatron's fused-kernel entry points, answered by the process's kernel provider (adapter.kernels).

Modules come in through megatron's spec extension point: ``get_gpt_layer_local_spec`` asks its
``LocalSpecProvider`` for the norm and core attention, so an unchanged model provider gets the kernel
provider's modules. Functions megatron reaches through a ``TransformerConfig`` fusion flag are replaced
where the flag sends them, so the flags keep their meaning: ``bias_activation_fusion`` (SwiGLU),
``apply_rope_fusion`` (RoPE), ``masked_softmax_fusion`` (softmax), ``cross_entropy_loss_fusion``.
A provider entry of None leaves megatron's own implementation in place. With multi-latent attention,
``apply_rope_fusion`` calls megatron's Triton YaRN RoPE kernels, which need a GPU: off CUDA the same
computation in torch (adapter/kernels/mla_rope.py) answers them on the cpu and npu backends.
"""

import functools
from functools import partial

from packaging.version import Version

from adapter import kernels
from adapter.cuda_only_features import RefusedSetting
from adapter.kernels import context_parallel, mla_rope
from adapter.registry import installed_megatron_core_version

_BACKENDS = "megatron.core.models.backends:LocalSpecProvider"
_ROPE = "megatron.core.models.common.embeddings.rope_utils"
_SOFTMAX = "megatron.core.fusions.fused_softmax:FusedScaleMaskSoftmax"
_MLA_ROPE = "megatron.core.fusions.fused_mla_yarn_rope_apply"
_MOE_UTILS = "megatron.core.transformer.moe.moe_utils"
_HYBRID_BLOCK = "megatron.core.models.hybrid.hybrid_block"
_HYBRID_VERSIONS = ">=0.18,<=0.19.2"
# What moe_utils imports from Transformer Engine and checks by ``not HAVE_TE or <name> is None``
MOE_PERMUTE_NAMES = ("fused_permute", "fused_permute_with_probs", "fused_unpermute", "fused_sort_chunks_by_index",
                     "fused_sort_chunks_by_index_with_probs")
_TE_ROUTER_NAMES = ("fused_moe_aux_loss", "fused_topk_with_score_function", "fused_compute_score_for_moe_aux_loss")


def _spec_layer_norm(self, rms_norm: bool = False, for_qk: bool = False, has_residual: bool = False):
    """LocalSpecProvider.layer_norm: the provider's norm reads config.normalization itself. 0.17+ marks with
    ``has_residual`` a norm whose residual add Transformer Engine may fuse (``fused_residual_rmsnorm``);
    megatron's local spec returns its plain norm then too, and so does this."""
    return kernels.norm_module()


def _spec_core_attention(self):
    return kernels.core_attention_module()


def _experts_are_builders() -> bool:
    """megatron-core 0.17 made ``grouped_mlp_modules(moe_use_grouped_gemm)`` return an experts builder (a
    ``partial`` of the experts class) and dropped the legacy GroupedMLP and its flag; 0.16 takes both
    flags and returns ``(experts class, submodules)``."""
    return Version(installed_megatron_core_version()) >= Version("0.17")


def _grouped_experts_from_provider(original):
    """LocalSpecProvider.grouped_mlp_modules: ``moe_grouped_gemm`` gets megatron's ``TEGroupedMLP`` over the
    provider's grouped linear layers, in the form the installed megatron-core asks for; without it
    (SequentialMLP) or, on 0.16, with the legacy flag (GroupedMLP), megatron's own choice stays."""
    if _experts_are_builders():
        def grouped_mlp_modules(self, moe_use_grouped_gemm: bool):
            if not moe_use_grouped_gemm:
                return original(self, moe_use_grouped_gemm)
            return _grouped_experts_builder(self)

        return grouped_mlp_modules

    def legacy_grouped_mlp_modules(self, moe_use_grouped_gemm: bool, moe_use_legacy_grouped_gemm: bool):
        if not moe_use_grouped_gemm or moe_use_legacy_grouped_gemm:
            return original(self, moe_use_grouped_gemm, moe_use_legacy_grouped_gemm)
        from megatron.core.transformer.mlp import MLPSubmodules
        from megatron.core.transformer.moe.experts import TEGroupedMLP

        fc1, fc2 = kernels.grouped_linear_modules()
        return TEGroupedMLP, MLPSubmodules(linear_fc1=fc1, linear_fc2=fc2)

    return legacy_grouped_mlp_modules


def _grouped_experts_builder(spec_provider):
    """0.17+: ``TEGroupedMLP`` over the provider's grouped linear layers, built as megatron's TE spec
    provider builds it (the activation module is the spec provider's, used only with
    ``use_te_activation_func``)."""
    from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP

    fc1, fc2 = kernels.grouped_linear_modules()
    return partial(TEGroupedMLP, submodules=GroupedMLPSubmodules(
        linear_fc1=fc1, linear_fc2=fc2, activation_func=spec_provider.activation_func()))


def _fused_interleaved_rope_allowed(post_init):
    """TransformerConfig.__post_init__ asks for Transformer Engine >= 2.3 before it lets fused RoPE rotate
    interleaved pairs; the provider's fused RoPE does that itself, so the check runs with fusion off."""

    def __post_init__(self):
        if not (self.apply_rope_fusion and self.rotary_interleaved and not self.multi_latent_attention):
            return post_init(self)
        self.apply_rope_fusion = False
        try:
            post_init(self)
        finally:
            self.apply_rope_fusion = True

    return __post_init__


def _mla_ring_attention_refused(validate_args):
    """Megatron-LM's ``validate_args``: multi-latent attention over ring (p2p) context parallelism, whose
    query/key and value head sizes differ, is refused in one line before any model is built (the core
    attention's own refusal comes at model build, on every rank)."""

    @functools.wraps(validate_args)
    def validate(args, *rest, **kwargs):
        if not getattr(args, "multi_latent_attention", False) or args.context_parallel_size == 1:
            return validate_args(args, *rest, **kwargs)
        comm_types = args.cp_comm_type if isinstance(args.cp_comm_type, (list, tuple)) else [args.cp_comm_type]
        qk, v = args.qk_head_dim + args.qk_pos_emb_head_dim, args.v_head_dim
        if context_parallel.ring_refuses(qk, v, comm_types):
            raise RefusedSetting(
                f"--multi-latent-attention (query/key head size {qk} = --qk-head-dim + --qk-pos-emb-head-dim, value "
                f"head size {v}) with --context-parallel-size {args.context_parallel_size} and --cp-comm-type "
                f"{' '.join(map(str, comm_types))}: {context_parallel.RING_HEAD_SIZES}; use --cp-comm-type a2a")
        return validate_args(args, *rest, **kwargs)

    return validate


def _cp_attention_refused(validate_args):
    """Megatron-LM's ``validate_args``, then, with context parallelism, what the adapter's CP attention
    cannot run (``context_parallel.arguments_refusal``) refused in one line before any model is built."""

    @functools.wraps(validate_args)
    def validate(args, *rest, **kwargs):
        validated = validate_args(args, *rest, **kwargs)
        problem = context_parallel.arguments_refusal(args) if args.context_parallel_size > 1 else None
        if problem:
            raise RefusedSetting(problem)
        return validated

    return validate


def _register_moe_permutation(registry, versions: str, provider) -> None:
    """``moe_permute_fusion`` runs the provider's permutation. Without Transformer Engine, moe_utils leaves
    its fused names unbound (0.16) or binds them to None (0.17+; a bind goes over None) and ``HAVE_TE``
    False, which guards nothing else there: with the names bound (the router's TE kernels to None, so
    megatron refuses ``moe_router_fusion`` by name) it is true."""
    for name in MOE_PERMUTE_NAMES:
        registry.bind(f"{_MOE_UTILS}:{name}", getattr(provider.moe_permute, name), versions=versions,
                      reason="moe_permute_fusion runs the kernel provider's token permutation")
    for name in _TE_ROUTER_NAMES:
        registry.bind(f"{_MOE_UTILS}:{name}", None, versions=versions,
                      reason="Transformer Engine's router kernel: None, so megatron names it when asked for")
    registry.replace(f"{_MOE_UTILS}:HAVE_TE", True, versions=versions, rebind_copies=False,
                     reason="moe_utils' HAVE_TE only guards the fused names, all bound now")


def _kernels_said(initialize_distributed):
    """megatron.training's ``_initialize_distributed``, then rank 0's one line saying what runs in place of
    megatron's silenced fallback warnings (``adapter.report.kernel_summary``: the backend, the kernel
    provider, each op and the optimizer)."""

    @functools.wraps(initialize_distributed)
    def initialize(*args, **kwargs):
        import torch

        result = initialize_distributed(*args, **kwargs)
        if torch.distributed.is_initialized() and torch.distributed.get_rank() == 0:
            from adapter.report import kernel_summary

            print(kernel_summary(), flush=True)
        return result

    return initialize


def _fusions_compile_at_first_use(tp_size=None) -> None:
    """megatron.training's ``_warmup_jit_function`` on the cpu backend: nothing. The warm-up runs megatron's
    ``jit_fuser`` functions (bias + SwiGLU or GeLU, bias + dropout + add) five times in each grad mode before
    the first step, so that CUDA's fusers have compiled them. Here ``jit_fuser`` is torch.compile, which
    compiles a function at its first call anyway; the warm-up compiled the variants with a bias too, which a
    model without biases never runs, and drew its inputs from the host generator, the one the weights are drawn
    from. Measured on qwen2.5-tiny: 1.0 s less from launch to the first iteration, the same losses."""


def register(registry, versions: str) -> None:
    provider = kernels.current()
    registry.wrap("megatron.training.initialize:_initialize_distributed", _kernels_said, versions=versions,
                  reason="rank 0 says which kernels run in place of megatron's fallback warnings, in one line")
    registry.replace("megatron.training.initialize:_warmup_jit_function", _fusions_compile_at_first_use,
                     versions=versions, backends=("cpu",),
                     reason="warms CUDA's JIT fusers; on the cpu backend torch.compile compiles at first use, and the "
                            "warm-up's variants cost start-up and draw from the host generator the weights use")
    registry.replace(f"{_BACKENDS}.layer_norm", _spec_layer_norm, versions=versions,
                     reason="the local spec's norm is the kernel provider's (supports sequence parallel; "
                            "0.17+'s has_residual asks for no other norm here)")
    registry.replace(f"{_BACKENDS}.core_attention", _spec_core_attention, versions=versions,
                     reason="the local spec's core attention is the kernel provider's flash attention")
    registry.wrap(f"{_BACKENDS}.grouped_mlp_modules", _grouped_experts_from_provider, versions=versions,
                  reason="moe_grouped_gemm in the local spec runs the provider's grouped GEMM (no grouped_gemm/TE): "
                         "0.16 gets (TEGroupedMLP, submodules), 0.17+ a TEGroupedMLP experts builder")
    _register_moe_permutation(registry, versions, provider)
    for name in ("fused_apply_mla_rope_for_q", "fused_apply_mla_rope_for_kv"):
        registry.replace(f"{_MLA_ROPE}:{name}", getattr(mla_rope, name), versions=versions, backends=("cpu", "npu"),
                         reason="apply_rope_fusion with MLA: megatron's Triton kernel needs a GPU; the same "
                                "computation in torch")
    registry.wrap("megatron.training.arguments:validate_args", _cp_attention_refused, versions=versions,
                  backends=("cpu", "npu"), reason="a CP comm type, head split or attention dropout the adapter's CP "
                                                  "attention cannot run fails at model build: one line before")
    registry.wrap("megatron.training.arguments:validate_args", _mla_ring_attention_refused, versions=versions,
                  backends=("cpu", "npu"), reason="MLA over ring context parallelism: the adapter's ring attention "
                                                  "takes one head size; one line before any model is built")
    if provider.installed_norm() is None:
        for target in ("megatron.core.transformer.transformer_block:LayerNormImpl",
                       "megatron.core.models.gpt.gpt_layer_specs:LNImpl"):
            registry.replace(target, provider.Norm, versions=versions, rebind_copies=False,
                             reason="the final norm of a block built from a layer spec is the provider's")
        # megatron-core 0.18 brought HybridModel, whose stack builds its final norm as TENorm whatever the spec
        if Version(installed_megatron_core_version()) >= Version("0.18"):
            registry.replace(f"{_HYBRID_BLOCK}:TENorm", provider.Norm, versions=_HYBRID_VERSIONS,
                             rebind_copies=False, reason="a hybrid stack's final norm (Qwen3.5, Qwen3-Next) is the "
                                                         "provider's")
    if provider.bias_swiglu is not None:
        registry.replace("megatron.core.fusions.fused_bias_swiglu:bias_swiglu_impl", provider.bias_swiglu,
                         versions=versions, reason="bias_activation_fusion SwiGLU runs the provider's kernel")
    if provider.rope is not None:
        registry.replace(f"{_ROPE}:fused_apply_rotary_pos_emb", provider.rope, versions=versions,
                         rebind_copies=False, reason="apply_rope_fusion runs the provider's RoPE kernel")
        registry.replace(f"{_ROPE}:fused_apply_rotary_pos_emb_thd", provider.rope_thd, versions=versions,
                         rebind_copies=False,
                         reason="apply_rope_fusion on packed sequences runs the provider's RoPE kernel")
        registry.wrap("megatron.core.transformer.transformer_config:TransformerConfig.__post_init__",
                      _fused_interleaved_rope_allowed, versions=versions,
                      reason="fused interleaved RoPE needs no Transformer Engine version here")
    if provider.softmax_fusable is not None:
        registry.replace(f"{_SOFTMAX}.is_kernel_available", provider.softmax_fusable, versions=versions,
                         reason="masked_softmax_fusion is decided by the provider's softmax kernel")
    if provider.scaled_masked_softmax is not None:
        registry.replace(f"{_SOFTMAX}.forward_fused_softmax", provider.scaled_masked_softmax,
                         versions=versions, reason="masked_softmax_fusion runs the provider's softmax kernel")
    if provider.vocab_parallel_cross_entropy is not None:
        registry.replace("megatron.core.fusions.fused_cross_entropy:fused_vocab_parallel_cross_entropy",
                         provider.vocab_parallel_cross_entropy, versions=versions,
                         reason="cross_entropy_loss_fusion runs the provider's cross entropy")

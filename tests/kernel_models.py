"""Rank function: the tiny GPT through the process's kernel provider against the same GPT on megatron's
own local modules. Run in a fresh process so ``ADAPTER_KERNELS`` picks the provider."""

from __future__ import annotations

import contextlib
import dataclasses

import adapter  # noqa: F401 - before megatron, as a user script does
import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from adapter import kernels
import models
from models.provider import transformer_config
from tests.kernel_reference import one_rank_model_parallel
from tests.triton_interpreter import compiler_semantics, interpreting

def _megatron_local_block(config) -> TransformerBlockSubmodules:
    """megatron's local layer spec with its own norm and DotProductAttention put back."""
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    attention = spec.submodules.self_attention
    attention = dataclasses.replace(attention, submodules=dataclasses.replace(
        attention.submodules, core_attention=DotProductAttention))
    layer = dataclasses.replace(spec, submodules=dataclasses.replace(
        spec.submodules, input_layernorm=WrappedTorchNorm, pre_mlp_layernorm=WrappedTorchNorm,
        self_attention=attention))
    return TransformerBlockSubmodules(layer_specs=[layer] * config.num_layers, layer_norm=WrappedTorchNorm)


def _gpt(flavor, config, spec) -> GPTModel:
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=flavor.vocab_size,
                    max_sequence_length=flavor.seq_length, position_embedding_type="rope",
                    share_embeddings_and_output_weights=False)


def _loss_and_grads(model, tokens, labels):
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    loss = model(tokens, positions, attention_mask=None, labels=labels).mean()
    loss.backward()
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}


def _as_compiled(provider):
    """The cuda provider's Liger kernels in a CPU rank run interpreted, with Triton's compiler semantics."""
    if getattr(provider, "FUSED", None) == "liger" and interpreting():
        return compiler_semantics()
    return contextlib.nullcontext()


def compare_with_megatron_local(fusion_flags: dict, flavor_name: str = "gpt-tiny") -> dict:
    with one_rank_model_parallel(), _as_compiled(kernels.current()):
        flavor = models.get(flavor_name)
        torch.manual_seed(0)
        ours = _gpt(flavor, transformer_config(flavor, **fusion_flags),
                    get_gpt_layer_local_spec(normalization="RMSNorm"))
        plain = transformer_config(flavor)
        reference = _gpt(flavor, plain, _megatron_local_block(plain))
        reference.load_state_dict(ours.state_dict())
        generator = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, flavor.vocab_size, (2, flavor.seq_length), generator=generator)
        labels = torch.roll(tokens, -1, dims=1)
        loss, grads = _loss_and_grads(ours, tokens, labels)
        ref_loss, ref_grads = _loss_and_grads(reference, tokens, labels)
        layer = ours.decoder.layers[0]
        result = dict(
            provider=kernels.current().NAME, fused=getattr(kernels.current(), "FUSED", None),
            loss=loss, reference_loss=ref_loss,
            grad_names=sorted(grads) == sorted(ref_grads),
            max_grad_diff=max((grads[n] - ref_grads[n]).abs().max().item() for n in grads),
            modules=[type(m).__name__ for m in (layer.input_layernorm, layer.pre_mlp_layernorm,
                                                layer.self_attention.core_attention,
                                                ours.decoder.final_layernorm)])
        try:
            import torch_npu
        except ImportError:
            return result
        result["npu_calls"] = dict(torch_npu.CALLS)
        # the provider's modules with every fusion flag off: megatron's unfused functions run
        torch_npu.CALLS.clear()
        _loss_and_grads(_gpt(flavor, plain, get_gpt_layer_local_spec(normalization="RMSNorm")), tokens, labels)
        result["npu_calls_flags_off"] = dict(torch_npu.CALLS)
        return result


def cross_entropy_across_tensor_parallel_ranks() -> float:
    """Largest difference, loss and logit gradient, between the adapter's vocab-parallel cross entropy
    and megatron's on this rank's vocabulary slice."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from adapter.kernels.cross_entropy import vocab_parallel_cross_entropy as ours

    adapter.init_distributed()
    parallel_state.initialize_model_parallel(torch.distributed.get_world_size(), 1)
    try:
        group = parallel_state.get_tensor_model_parallel_group()
        vocab, rank, size = 64, group.rank(), group.size()
        generator = torch.Generator().manual_seed(5)
        logits = torch.randn(6, 2, vocab, generator=generator) * 3
        target = torch.randint(0, vocab, (6, 2), generator=generator)
        local = logits[..., rank * vocab // size:(rank + 1) * vocab // size]
        results = []
        for fn in (lambda x: ours(x, target, group), lambda x: vocab_parallel_cross_entropy(x, target)):
            x = local.clone().requires_grad_(True)
            loss = fn(x)
            (loss * torch.arange(loss.numel()).view(loss.shape)).sum().backward()
            results.append((loss.detach(), x.grad))
        (loss, grad), (ref_loss, ref_grad) = results
        return max((loss - ref_loss).abs().max().item(), (grad - ref_grad).abs().max().item())
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def moe_losses(dispatcher: str, steps: int = 3) -> dict:
    """A tiny MoE GPT (4 experts, top-2, grouped GEMM and fused permutation on) trained ``steps`` Adam
    steps through the process's kernel provider: its losses, and torch_npu's op counts where it is the
    double."""
    with one_rank_model_parallel():
        flavor = models.get("gpt-tiny")
        config = transformer_config(flavor, num_moe_experts=4, moe_router_topk=2, moe_grouped_gemm=True,
                                    moe_permute_fusion=True, moe_token_dispatcher_type=dispatcher,
                                    moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2)
        torch.manual_seed(0)
        model = _gpt(flavor, config, get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=True,
                                                              normalization="RMSNorm"))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        generator = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(steps):
            tokens = torch.randint(0, flavor.vocab_size, (2, flavor.seq_length), generator=generator)
            optimizer.zero_grad()
            loss, _ = _loss_and_grads(model, tokens, torch.roll(tokens, -1, dims=1))
            optimizer.step()
            losses.append(loss)
        experts = model.decoder.layers[0].mlp.experts
        result = dict(provider=kernels.current().NAME, losses=losses,
                      experts=[type(experts).__name__, type(experts.linear_fc1).__name__])
        try:
            import torch_npu
        except ImportError:
            return result
        return {**result, "npu_calls": dict(torch_npu.CALLS)}

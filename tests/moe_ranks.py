"""Rank functions of the MoE tests: megatron-core's MoE GPT trained as a user writes it, after ``import adapter``.

The tiny GPT of scripts/train_tiny_gpt.py (4 layers, hidden 64, seq 32, fp32) with 4 experts, top-2, built with
megatron's own ``get_gpt_decoder_block_spec`` (local, no Transformer Engine; it honours ``moe_layer_freq``) and
trained through DDP, ``get_megatron_optimizer`` and the pipeline schedule by ``train_tiny_gpt.train_step``.

megatron initialises each rank's experts from the random stream as that rank meets them, so expert 2 at EP2
gets what expert 0 gets at EP1. To compare layouts, a run at any other layout first builds the TP1 x EP1 model
from the seed and copies its weights, by the layout-free keys of megatron's ``sharded_state_dict``, into the
model of its own layout: one model, whatever the layout.
"""

from __future__ import annotations

import dataclasses

import adapter
import torch
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import track_moe_metrics

import models
from scripts.train_tiny_gpt import Run, batches, finish, train_step

MOE = {"num_moe_experts": 4, "moe_router_topk": 2, "moe_grouped_gemm": False}


@dataclasses.dataclass(frozen=True)
class MoeRun:
    """A training run of the MoE GPT: ``run`` (TP, SP, steps, batches, ...), the expert-parallel size and
    TransformerConfig settings over ``MOE`` as ``(name, value)`` pairs."""

    run: Run = Run(steps=5, distributed_optimizer=True)
    ep: int = 1
    settings: tuple = ()


def _config(moe: MoeRun, flavor, tp: int, ep: int) -> TransformerConfig:
    """The tiny GPT's TransformerConfig (SwiGLU, RMSNorm, GQA, no biases, fp32) with ``MOE`` and ``moe.settings``
    at TP ``tp`` x EP ``ep``. Weights initialised on the host and split, as models/provider.py does."""
    return TransformerConfig(
        num_layers=flavor.num_layers, hidden_size=flavor.hidden_size, ffn_hidden_size=flavor.ffn_hidden_size,
        num_attention_heads=flavor.num_attention_heads, num_query_groups=flavor.num_query_groups,
        normalization=flavor.normalization, layernorm_epsilon=flavor.norm_epsilon, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        init_method_std=0.02, pipeline_dtype=torch.float32, use_cpu_initialization=True, cuda_graph_scope=[],
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
        sequence_parallel=moe.run.sequence_parallel and tp > 1, **{**MOE, **dict(moe.settings)})


def build(moe: MoeRun, tp: int, ep: int):
    """The TransformerConfig and seeded GPTModel of ``moe`` on the groups initialised for TP ``tp`` x EP ``ep``."""
    flavor = models.get(moe.run.flavor)
    torch.manual_seed(moe.run.seed)
    model_parallel_cuda_manual_seed(moe.run.seed)
    config = _config(moe, flavor, tp, ep)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=flavor.normalization)
    return config, GPTModel(config=config, transformer_layer_spec=spec, vocab_size=flavor.vocab_size,
                            max_sequence_length=flavor.max_position_embeddings,
                            position_embedding_type=flavor.position_embedding, rotary_base=flavor.rotary_base)


def _shards(model) -> list[ShardedTensor]:
    """This rank's pieces of the model's tensors, each with its layout-free key and place in the whole."""
    sharded = model.sharded_state_dict()
    apply_factories(sharded)  # the SwiGLU fc1 as its two halves, each split over TP on its own
    return [t for t in nested_values(sharded) if isinstance(t, ShardedTensor)]


def _whole_weights(model) -> dict:
    """key -> the whole tensor, from a model that holds all of it (TP1 x EP1)."""
    whole = {}
    for shard in _shards(model):
        whole.setdefault(shard.key, torch.empty(shard.global_shape))[shard.global_slice()] = shard.data
    return whole


def _load_whole_weights(model, whole: dict) -> None:
    with torch.no_grad():
        for shard in _shards(model):
            shard.data.copy_(whole[shard.key][shard.global_slice()])


def _distributed(config, model, run: Run):
    """DDP with overlapped bucketed grad reduction, megatron's optimizer and finalize_model_grads, as
    train_tiny_gpt.build wires them."""
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=True,
                                               use_distributed_optimizer=run.distributed_optimizer,
                                               bucket_size=run.bucket_size)
    chunk = DistributedDataParallel(config, ddp_config, model)
    config.no_sync_func = chunk.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=run.lr, weight_decay=0.01, clip_grad=1.0,
                        use_distributed_optimizer=run.distributed_optimizer), [chunk])
    config.grad_scale_func = optimizer.scale_loss
    return chunk, optimizer


def setup(moe: MoeRun):
    """Groups for ``moe``'s layout, the model with the TP1 x EP1 weights, DDP and the optimizer."""
    adapter.init_distributed()
    flavor = models.get(moe.run.flavor)
    tp = moe.run.tp
    whole = None
    if (tp, moe.ep) != (1, 1):
        parallel_state.initialize_model_parallel(1, 1)
        whole = _whole_weights(build(moe, 1, 1)[1])
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tp, 1, expert_model_parallel_size=moe.ep)
    config, model = build(moe, tp, moe.ep)
    if whole is not None:
        _load_whole_weights(model, whole)
    return flavor, config, *_distributed(config, model, moe.run)


def _leave_groups() -> None:
    """Drop this run's model-parallel groups, so the next run of the same ranks builds its own layout."""
    torch.distributed.barrier()
    parallel_state.destroy_model_parallel()


class _Scalars:
    """A tensorboard SummaryWriter's ``add_scalar``, kept: what track_moe_metrics logs."""

    def __init__(self):
        self.logged = {}

    def add_scalar(self, name, value, iteration):
        self.logged[name] = float(value)


def _record(model) -> dict:
    """Hooks that keep, per layer number and in the order the micro-batches come, what each router saw and
    chose (its logits, worked out here as the hidden states times its weight, the expert bias it routed with,
    the probabilities and routing map it returned) and what each shared expert took, held and gave."""
    record = {"routing": {}, "shared": {}}

    def router_hook(router, inputs, outputs):
        logits = torch.nn.functional.linear(inputs[0].detach(), router.weight.detach())
        bias = None if router.expert_bias is None else router.expert_bias.clone()
        record["routing"].setdefault(router.layer_number, []).append(
            {"logits": logits, "expert_bias": bias, "probs": outputs[0].detach().clone(), "map": outputs[1].clone()})

    def shared_hook(layer_number):
        def hook(shared, inputs, output):
            weights = {name: p.detach().clone() for name, p in shared.named_parameters()}
            record["shared"].setdefault(layer_number, []).append(
                {"input": inputs[0].detach().clone(), "output": output.detach().clone(), **weights})
        return hook

    for layer in model.decoder.layers:
        if isinstance(layer.mlp, MoELayer):
            layer.mlp.router.register_forward_hook(router_hook)
            if layer.mlp.shared_experts is not None:
                layer.mlp.shared_experts.register_forward_hook(shared_hook(layer.layer_number))
    return record


def _step_metrics(moe: MoeRun, config, model, flavor, step: int) -> dict:
    """What Megatron-LM's training log gets from track_moe_metrics after a step (per layer too), with the loss
    scale it passes (1 / this rank's micro-batches), and the routers' expert biases after the step."""
    scalars, totals = _Scalars(), {}
    track_moe_metrics(1 / len(batches(moe.run, flavor, step)), step, writer=scalars, total_loss_dict=totals,
                      per_layer_logging=True, num_layers=config.num_layers, moe_layer_freq=config.moe_layer_freq)
    biases = {layer.layer_number: layer.mlp.router.expert_bias.clone() for layer in model.decoder.layers
              if isinstance(layer.mlp, MoELayer) and layer.mlp.router.expert_bias is not None}
    return {"logged": scalars.logged, "totals": {name: float(value) for name, value in totals.items()},
            "expert_bias": biases}


def train(runs: dict[str, MoeRun]) -> dict:
    """Each run of ``runs`` (name -> run) in turn, on the same ranks: per step the global-batch lm loss as
    train_tiny_gpt reports it (the aux losses reach the routers as gradients only) and ``_step_metrics``; what
    ``_record`` kept; the kind of each layer's MLP."""
    out = {}
    for name, moe in runs.items():
        flavor, config, chunk, optimizer = setup(moe)
        record = _record(chunk.module)
        steps = []
        for step in range(moe.run.steps):
            loss = train_step(moe.run, flavor, [chunk], optimizer, step)[0]
            steps.append({"loss": loss, **_step_metrics(moe, config, chunk.module, flavor, step)})
        kinds = [type(layer.mlp).__name__ for layer in chunk.module.decoder.layers]
        out[name] = {"steps": steps, **record, "layers": kinds}
        _leave_groups()
    finish()
    return out

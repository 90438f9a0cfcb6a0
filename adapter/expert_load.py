"""Each MoE layer's expert load, for the training log: the tokens each expert is routed, counted in training
forwards and summed over all ranks at each log line, shown as max/mean tokens per expert.

megatron-core logs its router losses but not the load itself: a hook on each router counts its routing map in
training forwards only (under autograd, as megatron counts for its expert bias, so neither evaluation nor a
recomputed forward counts), and not the MTP layers' routers. Every token is routed on exactly one rank of its
pipeline stage, since megatron requires sequence parallelism for MoE at TP > 1, so the sum over all ranks is
the tokens each expert took. Max/mean is 1 perfectly balanced, the number of experts when one expert took every
token. megatron.training's log shows it on a line of its own after each iteration line, and as TensorBoard
scalars (patches/expert_load.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from adapter import device


@dataclass
class Summary:
    """Each MoE layer's load over a log line's iterations, under the layer numbers the log shows."""

    layers: list[int]
    load: list[float]  # max/mean tokens per expert, per layer
    shares: list[list[float]]  # each expert's share of the layer's tokens

    def field(self) -> str:
        """The iteration line's field: the mean over the layers, and the worst layer."""
        worst = max(range(len(self.load)), key=self.load.__getitem__)
        return (f"expert load max/mean: {self.mean():.3f} (worst: layer {self.layers[worst]} "
                f"{self.load[worst]:.3f})")

    def mean(self) -> float:
        return sum(self.load) / len(self.load)

    def write(self, writer, iteration: int, per_expert: bool) -> None:
        """The TensorBoard scalars (each expert's share too with ``per_expert``, --moe-per-layer-logging)."""
        writer.add_scalar("expert-load-max-over-mean", self.mean(), iteration)
        for layer, value, layer_shares in zip(self.layers, self.load, self.shares):
            writer.add_scalar(f"moe/expert_load_max_over_mean_layer_{layer}", value, iteration)
            if per_expert:
                for expert, share in enumerate(layer_shares):
                    writer.add_scalar(f"moe/tokens_per_expert_layer_{layer}/expert_{expert}", share, iteration)


class ExpertLoad:
    """The tokens each expert of each MoE layer is routed, counted by hooks on the model's routers."""

    def __init__(self, num_layers: int, num_experts: int, model: list):
        """``num_layers``: megatron's decoder layers (a router numbered past them is an MTP layer's). megatron
        is imported here, not with the module: ``import adapter`` (which registers this module's patch) must
        leave megatron unimported, so that the routing sees every megatron module imported."""
        from megatron.core.transformer.moe.router import TopKRouter

        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.long, device=device.current_device())
        for chunk in model:
            for module in chunk.modules():
                if isinstance(module, TopKRouter):
                    module.register_forward_hook(self._count)

    def _count(self, router, inputs, output) -> None:
        if router.training and torch.is_grad_enabled() and not self._in_mtp_layer(router):
            routing_map = output[1]
            self.counts[router.layer_number - 1] += routing_map.sum(dim=0)

    def _in_mtp_layer(self, router) -> bool:
        """Whether ``router`` routes an MTP layer's tokens, which the load leaves out: 0.17+ flag it
        (``is_mtp_layer``); 0.16 numbers the MTP layers on after the decoder's."""
        return getattr(router, "is_mtp_layer", False) or router.layer_number > self.counts.shape[0]

    def summary(self, layers: dict[int, int] | None = None, reset: bool = True) -> Summary:
        """At a log line, on every rank (a collective): the load since the last reset of the MoE layers
        ``layers`` (megatron's 0-based layer index -> the number the log shows); None: the layers whose routers
        took tokens, on any rank and pipeline stage (every MoE layer routes each training forward's tokens),
        shown by megatron's index. ``reset`` starts the count anew."""
        counts = self.counts.clone()
        torch.distributed.all_reduce(counts)
        if reset:
            self.counts.zero_()
        if layers is None:
            layers = {i: i for i in counts.sum(dim=1).nonzero().flatten().tolist()}
        counts = counts[list(layers)].double()
        shares = counts / counts.sum(dim=1, keepdim=True).clamp(min=1)
        load = counts.max(dim=1).values / counts.mean(dim=1).clamp(min=1e-12)
        return Summary(list(layers.values()), load.tolist(), shares.tolist())

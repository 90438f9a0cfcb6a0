"""The experts' linear layers for ``moe_grouped_gemm``: one module per projection holding every local
expert, computed by the provider's grouped matmul.

megatron-core's MoE layer takes its grouped experts from the layer spec: ``TEGroupedMLP`` over two
grouped linear submodules (Transformer Engine's ``TEColumnParallelGroupedLinear`` /
``TERowParallelGroupedLinear`` in megatron's TE spec). ``TEGroupedMLP`` itself needs no Transformer
Engine; only its submodules do. These classes keep the interface of TE's, so the same ``TEGroupedMLP``
runs on every backend:

    forward(x [tokens, in], tokens_per_expert: list[int] | int tensor) -> (y [tokens, out], bias or None)

The local experts' weights are ONE parameter ``weight`` [experts, out, in] (and ``bias`` [experts, out]):
the layout a grouped GEMM reads without copying, and one parameter instead of one per expert for
megatron's per-parameter DDP hooks, optimizer and gradient-clipping loops. Checkpoints still hold one
tensor per global expert under the keys and shapes SequentialMLP and Transformer Engine use (a
``ShardedTensorFactory`` splits the parameter on save and stacks it on load, as megatron 0.16's legacy
GroupedMLP does for its fused weights), so they stay interchangeable with both.

Rows of ``x`` come grouped by local expert, ``tokens_per_expert[i]`` rows for expert i (what the token
dispatcher hands over). The provider's ``grouped_mm(x, weight, tokens_per_expert)`` computes
``y[rows of i] = x[rows of i] @ weight[i].T`` with gradients (a provider whose kernel has no backward
supplies it). Like TE's under expert parallelism, these modules never communicate: the dispatcher
moves the tokens, and an expert-tensor-parallel shard is just a narrower weight.
"""

from __future__ import annotations

import torch
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name
from megatron.core.tensor_parallel.utils import divide
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

from adapter import device as device_layer

_PARTITION_DIM = {"column": 0, "row": 1}  # the [out, in] dim an expert-tensor-parallel rank holds a slice of


class GroupedLinear(torch.nn.Module):
    """``num_gemms`` local experts' weights as one ``weight`` [num_gemms, out, in] (and ``bias``
    [num_gemms, out]) for TEGroupedMLP; ``grouped_mm`` is bound per provider by
    ``adapter.kernels.grouped_linear_modules``."""

    grouped_mm = None
    parallel_mode = None  # "column" or "row", set by the subclasses

    def __init__(self, num_gemms: int, input_size: int, output_size: int, *, config, init_method,
                 bias: bool, skip_bias_add: bool, is_expert: bool = True, tp_comm_buffer_name=None,
                 pg_collection: ProcessGroupCollection | None = None, name: str | None = None):
        """The arguments megatron's TEGroupedMLP passes its fc1 / fc2 builders. ``tp_comm_buffer_name``
        (TE's userbuffer overlap) and 0.18+'s ``name`` (the module's path, for TE's debug tooling) are
        accepted and unused, as megatron's own ColumnParallelLinear does with them."""
        super().__init__()
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        self.config, self.num_gemms, self.use_bias = config, num_gemms, bias
        self.return_bias = skip_bias_add and bias
        self._pg_collection, self._tp_group = pg_collection, pg_collection.expt_tp
        dim = _PARTITION_DIM[self.parallel_mode]
        # fc1 of a gated unit: each expert-TP rank holds its slice of the gate and of the up projection,
        # as megatron's MLP (stride 2) and its checkpoints' swiglu factory lay them out
        self.stride = 2 if self.parallel_mode == "column" and config.gated_linear_unit else 1
        shape = [output_size, input_size]
        shape[dim] = divide(shape[dim], self._tp_group.size())
        self.weight = self._new_parameter([num_gemms, *shape])
        # the expert axis comes first, so the sliced dim is one further than in megatron's [out, in]
        set_tensor_model_parallel_attributes(self.weight, is_parallel=True, dim=dim + 1, stride=self.stride)
        if bias:
            # a row-parallel bias is whole on every expert-TP rank, as in megatron's RowParallelLinear
            self.bias = self._new_parameter([num_gemms, shape[0] if self.parallel_mode == "column" else output_size])
            with torch.no_grad():
                self.bias.zero_()
            set_tensor_model_parallel_attributes(self.bias, self.parallel_mode == "column", 1, 1)
        else:
            self.register_parameter("bias", None)
        if config.perform_initialization:
            self._initialize(init_method, output_size, input_size, dim)
        expert_parallel = config.expert_model_parallel_size > 1
        for param in self.parameters():
            # megatron's DDP reduces expert-parallel parameters over the expert data-parallel group
            param.allreduce = not (is_expert and expert_parallel)

    def _new_parameter(self, shape: list[int]) -> torch.nn.Parameter:
        """Uninitialised, on the host for ``use_cpu_initialization`` (moved later by the model), else on
        the device, in ``params_dtype``: where and how megatron's own linear layers allocate theirs."""
        device = None if self.config.use_cpu_initialization else device_layer.torch_device()
        return torch.nn.Parameter(torch.empty(shape, device=device, dtype=self.config.params_dtype))

    def _initialize(self, init_method, output_size: int, input_size: int, dim: int) -> None:
        """With ``use_cpu_initialization``, every rank draws every global expert's full weight in order and
        keeps its own slice, so one seed gives the same experts at any EP / expert-TP layout (as megatron's
        CPU initialisation does for TP). Otherwise each local expert's slice is drawn on the device with the
        expert RNG, as megatron's device initialisation of expert weights does. Either way expert by
        expert, as [out, in] matrices: an init_method may depend on a matrix's fan-in and fan-out."""
        if not self.config.use_cpu_initialization:
            with torch.no_grad(), get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
                for expert in self.weight:
                    init_method(expert)
            return
        ep_group, tp_rank, tp_size = self._pg_collection.ep, self._tp_group.rank(), self._tp_group.size()
        first, chunk = ep_group.rank() * self.num_gemms, self.weight.shape[dim + 1] // self.stride
        with torch.no_grad():
            for expert in range(ep_group.size() * self.num_gemms):
                master = torch.empty(output_size, input_size, dtype=torch.float32)
                init_method(master)
                if first <= expert < first + self.num_gemms:
                    mine = torch.cat(master.split(chunk, dim=dim)[tp_rank::tp_size], dim=dim)
                    self.weight[expert - first].copy_(mine.to(self.config.params_dtype))

    def forward(self, x: torch.Tensor, tokens_per_expert):
        out = self.grouped_mm(x, self.weight, tokens_per_expert)
        if not self.use_bias:
            return out, None
        if self.return_bias:
            return out, self.bias
        counts = torch.as_tensor(tokens_per_expert, device=out.device)
        expert_of_row = torch.repeat_interleave(torch.arange(self.num_gemms, device=out.device), counts,
                                                output_size=out.shape[0])
        return out + self.bias[expert_of_row].to(out.dtype), None

    def backward_dw(self) -> None:
        """Weight gradients are computed in the backward pass (no delayed wgrad here)."""

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """Plain state dicts saved before the experts shared one parameter hold ``weight{i}`` / ``bias{i}``
        per local expert: stacked here into ``weight`` / ``bias`` so they still load."""
        for name in ("weight", "bias"):
            old = [f"{prefix}{name}{i}" for i in range(self.num_gemms)]
            if f"{prefix}{name}" not in state_dict and all(key in state_dict for key in old):
                state_dict[f"{prefix}{name}"] = torch.stack([state_dict.pop(key) for key in old])
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Each parameter as a factory of one tensor per local expert, keyed, shaped and offset as the
        global expert's shard in SequentialMLP's and Transformer Engine's layout (``TEGroupedMLP`` adds the
        ``experts.`` prefix), so a checkpoint loads at another EP / expert-TP size or into the other expert
        layouts. The factory holds the parameter itself: megatron's optimizers find a parameter's sharding
        by the identity of its tensor and apply the same factory to its optimizer state."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        column = self.parallel_mode == "column"
        tp_axes = {"weight": _PARTITION_DIM[self.parallel_mode], "bias": 0 if column else None}
        return {f"{prefix}{name}": self._expert_factory(f"{prefix}{name}", param, tp_axes[name], sharded_offsets,
                                                        metadata.get("singleton_local_shards", False))
                for name, param in self.named_parameters(recurse=False)}

    def _expert_factory(self, key: str, param: torch.nn.Parameter, tp_axis: int | None, sharded_offsets: tuple,
                        singleton: bool) -> ShardedTensorFactory:
        """The factory for one parameter: ``tp_axis`` is the per-expert axis sliced over expert TP (None:
        whole on every expert-TP rank, so those ranks are its replicas); replicas of an expert are also
        the expert-data-parallel ranks, not the data-parallel ones."""
        tp_rank = self._tp_group.rank()
        replica_id = (0, 0 if tp_axis is not None else tp_rank, self._pg_collection.expt_dp.rank())
        tail = key  # what later prefix replacements keep: a singleton key gets the global expert before it
        gated = self.stride == 2 and tp_axis == 0  # fc1's gate and up halves, saved as separate shards

        def build(key, data, replica_id, flattened_range):
            if flattened_range is not None:
                raise ValueError(f"{key}: the grouped experts' checkpoint needs whole parameters, got the flat "
                                 f"range {flattened_range} (distributed optimizer format "
                                 "fully_sharded_model_space): save with fully_reshardable or dp_reshardable")
            return [self._expert_shards(key, tail, expert, data[expert], replica_id, tp_axis, sharded_offsets,
                                        singleton, gated)
                    for expert in range(self.num_gemms)]

        def merge(loaded: list) -> torch.Tensor:
            with torch.no_grad():
                return torch.stack([torch.cat(halves) if gated else halves for halves in loaded])

        return ShardedTensorFactory(key, param, build, merge, replica_id)

    def _expert_shards(self, key: str, tail: str, expert: int, tensor: torch.Tensor, replica_id, tp_axis,
                       sharded_offsets: tuple, singleton: bool, gated: bool):
        """Local expert ``expert``'s tensor as its global expert's ShardedTensor (two for a gated fc1: the
        gate half and the up half, with megatron's swiglu offsets), as megatron's SequentialMLP / TEGroupedMLP
        save one expert: an expert axis before the tensor's own, or (singleton_local_shards) a key per
        global expert and no expert axis."""
        ep_group, tp_size, tp_rank = self._pg_collection.ep, self._tp_group.size(), self._tp_group.rank()
        global_expert = ep_group.rank() * self.num_gemms + expert
        if singleton:
            if not key.endswith(tail):
                raise ValueError(f"sharded key {key!r} no longer ends with {tail!r}: the grouped experts cannot "
                                 "place the global expert index in it")
            key, offsets = f"{key[:-len(tail)]}{global_expert}.{tail}", tuple(sharded_offsets)
        else:
            offsets = (*sharded_offsets, (len(sharded_offsets), global_expert, ep_group.size() * self.num_gemms))
        prepend = len(offsets)

        def shard(name: str, part: torch.Tensor, *tp_offset) -> ShardedTensor:
            return ShardedTensor.from_rank_offsets(name, part.contiguous(), *offsets, *tp_offset,
                                                   replica_id=replica_id, prepend_axis_num=prepend)

        if not gated:
            return shard(key, tensor, *([] if tp_axis is None else [(prepend + tp_axis, tp_rank, tp_size)]))
        gate, up = torch.chunk(tensor, 2, dim=0)
        if singleton:
            return [shard(f"{key}_w", gate, (prepend, tp_rank, tp_size)),
                    shard(f"{key}_v", up, (prepend, tp_rank, tp_size))]
        return [shard(key, gate, (prepend, tp_rank, 2 * tp_size)),
                shard(key, up, (prepend, tp_size + tp_rank, 2 * tp_size))]


class ColumnParallelGroupedLinear(GroupedLinear):
    """The experts' first projection (fc1): an expert-TP rank holds a slice of the output features."""

    parallel_mode = "column"


class RowParallelGroupedLinear(GroupedLinear):
    """The experts' second projection (fc2): an expert-TP rank holds a slice of the input features."""

    parallel_mode = "row"

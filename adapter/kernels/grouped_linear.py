"""The experts' linear layers for ``moe_grouped_gemm``: one module per projection holding every local
expert, computed by the provider's grouped matmul.

megatron-core's MoE layer takes its grouped experts from the layer spec: ``TEGroupedMLP`` over two
grouped linear submodules (Transformer Engine's ``TEColumnParallelGroupedLinear`` /
``TERowParallelGroupedLinear`` in megatron's TE spec). ``TEGroupedMLP`` itself needs no Transformer
Engine; only its submodules do. These classes keep the interface and the weight layout of TE's, so the
same ``TEGroupedMLP`` runs on every backend and its checkpoints are interchangeable with TE's and with
``SequentialMLP``'s (one ``weight{i}`` of [out, in] per local expert, sharded per global expert):

    forward(x [tokens, in], m_splits: list[int]) -> (y [tokens, out], bias or None)

Rows of ``x`` come grouped by local expert, ``m_splits[i]`` rows for expert i (what the token
dispatcher hands over). The provider's ``grouped_mm(x, weights, m_splits)`` computes
``y[rows of i] = x[rows of i] @ weights[i].T`` with gradients (a provider whose kernel has no backward
supplies it). Like TE's under expert parallelism, these modules never communicate: the dispatcher
moves the tokens, and an expert-tensor-parallel shard is just a narrower weight.
"""

from __future__ import annotations

import torch
from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name
from megatron.core.tensor_parallel.utils import divide
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

from adapter import device as device_layer

_PARTITION_DIM = {"column": 0, "row": 1}  # the weight dim an expert-tensor-parallel rank holds a slice of


class GroupedLinear(torch.nn.Module):
    """``num_gemms`` local experts' weights ``weight{i}`` [out, in] (and ``bias{i}``) for TEGroupedMLP;
    ``grouped_mm`` is bound per provider by ``adapter.kernels.grouped_linear_modules``."""

    grouped_mm = None
    parallel_mode = None  # "column" or "row", set by the subclasses

    def __init__(self, num_gemms: int, input_size: int, output_size: int, *, config, init_method,
                 bias: bool, skip_bias_add: bool, is_expert: bool = True, tp_comm_buffer_name=None,
                 pg_collection: ProcessGroupCollection | None = None):
        super().__init__()
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        self.config, self.num_gemms, self.use_bias = config, num_gemms, bias
        self.return_bias = skip_bias_add and bias
        self._pg_collection, self._tp_group = pg_collection, pg_collection.expt_tp
        tp_size = self._tp_group.size()
        dim = _PARTITION_DIM[self.parallel_mode]
        # fc1 of a gated unit: each expert-TP rank holds its slice of the gate and of the up projection,
        # as megatron's MLP (stride 2) and its checkpoints' swiglu factory lay them out
        self.stride = 2 if self.parallel_mode == "column" and config.gated_linear_unit else 1
        shape = [output_size, input_size]
        shape[dim] = divide(shape[dim], tp_size)
        device = None if config.use_cpu_initialization else device_layer.torch_device()
        for i in range(num_gemms):
            weight = torch.nn.Parameter(torch.empty(shape, device=device, dtype=config.params_dtype))
            set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=dim, stride=self.stride)
            self.register_parameter(f"weight{i}", weight)
            if bias:
                # a row-parallel bias is whole on every expert-TP rank, as in megatron's RowParallelLinear
                rows = shape[0] if self.parallel_mode == "column" else output_size
                self.register_parameter(f"bias{i}", torch.nn.Parameter(
                    torch.zeros(rows, device=device, dtype=config.params_dtype)))
                set_tensor_model_parallel_attributes(getattr(self, f"bias{i}"), self.parallel_mode == "column",
                                                     0, 1)
        if config.perform_initialization:
            self._initialize(init_method, output_size, input_size, dim)
        expert_parallel = config.expert_model_parallel_size > 1
        for param in self.parameters():
            # megatron's DDP reduces expert-parallel parameters over the expert data-parallel group
            param.allreduce = not (is_expert and expert_parallel)

    def _initialize(self, init_method, output_size: int, input_size: int, dim: int) -> None:
        """With ``use_cpu_initialization``, every rank draws every global expert's full weight in order and
        keeps its own slice, so one seed gives the same experts at any EP / expert-TP layout (as megatron's
        CPU initialisation does for TP). Otherwise each local slice is drawn on the device with the expert RNG,
        as megatron's device initialisation of expert weights does."""
        weights = [getattr(self, f"weight{i}") for i in range(self.num_gemms)]
        if not self.config.use_cpu_initialization:
            with torch.no_grad(), get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
                for weight in weights:
                    init_method(weight)
            return
        ep_group, tp_rank, tp_size = self._pg_collection.ep, self._tp_group.rank(), self._tp_group.size()
        first, chunk = ep_group.rank() * self.num_gemms, weights[0].shape[dim] // self.stride
        with torch.no_grad():
            for expert in range(ep_group.size() * self.num_gemms):
                master = torch.empty(output_size, input_size, dtype=torch.float32)
                init_method(master)
                if first <= expert < first + self.num_gemms:
                    mine = torch.cat(master.split(chunk, dim=dim)[tp_rank::tp_size], dim=dim)
                    weights[expert - first].copy_(mine.to(self.config.params_dtype))

    def forward(self, x: torch.Tensor, m_splits: list[int]):
        weights = [getattr(self, f"weight{i}") for i in range(self.num_gemms)]
        out = self.grouped_mm(x, weights, m_splits)
        if not self.use_bias:
            return out, None
        biases = torch.stack([getattr(self, f"bias{i}") for i in range(self.num_gemms)])
        if self.return_bias:
            return out, biases
        expert_of_row = torch.repeat_interleave(
            torch.arange(self.num_gemms, device=out.device),
            torch.tensor(m_splits, device=out.device), output_size=out.shape[0])
        return out + biases[expert_of_row].to(out.dtype), None

    def backward_dw(self) -> None:
        """Weight gradients are computed in the backward pass (no delayed wgrad here)."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Each local expert's tensors as the global expert's shard, under the keys SequentialMLP and
        Transformer Engine's grouped linear use (``TEGroupedMLP`` adds the ``experts.`` prefix), so a
        checkpoint loads at another EP / expert-TP size or into the other expert layouts."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        singleton = metadata.get("singleton_local_shards", False)
        ep_group = self._pg_collection.ep
        num_global, first = ep_group.size() * self.num_gemms, ep_group.rank() * self.num_gemms
        axis = {"weight": _PARTITION_DIM[self.parallel_mode]}
        if self.parallel_mode == "column":
            axis["bias"] = 0
        sharded = {}
        for i in range(self.num_gemms):
            names = ["weight"] + (["bias"] if self.use_bias else [])
            state = {f"{i}.{name}": getattr(self, f"{name}{i}") for name in names}
            offsets = sharded_offsets if singleton else (
                *sharded_offsets, (len(sharded_offsets), first + i, num_global))
            sub = make_sharded_tensors_for_checkpoint(
                state, "", {f"{i}.{name}": dim for name, dim in axis.items()}, offsets,
                tp_group=self._tp_group, dp_cp_group=metadata["dp_cp_group"])
            replace_prefix_for_sharding(sub, f"{i}.", f"{first + i}.{prefix}" if singleton else prefix)
            sharded.update({f"{prefix}{name}{i}": sub[f"{i}.{name}"] for name in names})
        expert_dp_rank = self._pg_collection.expt_dp.rank()
        for tensor in sharded.values():
            # replicas of an expert are the expert-data-parallel ranks, not the data-parallel ones
            tensor.replica_id = (*tensor.replica_id[:2], expert_dp_rank)
        return sharded


class ColumnParallelGroupedLinear(GroupedLinear):
    """The experts' first projection (fc1): an expert-TP rank holds a slice of the output features."""

    parallel_mode = "column"


class RowParallelGroupedLinear(GroupedLinear):
    """The experts' second projection (fc2): an expert-TP rank holds a slice of the input features."""

    parallel_mode = "row"

"""The MoE experts' grouped GEMM per kernel provider (issue 15, item 2), held to independent references:
a row-by-row float64 product for the op, megatron's own ``SequentialMLP`` for the layer."""

import pytest
import torch

import adapter  # noqa: F401 - before megatron
from tests import spec_entries
from tests.kernel_reference import TOLERANCE, one_rank_model_parallel

SPLITS = [3, 0, 5, 2]  # the second expert receives no token


def _expert_weight(dtype, out_features=8, in_features=12):
    """The experts' stacked weight [experts, out, in], as GroupedLinear holds it."""
    generator = torch.Generator().manual_seed(1)
    return torch.randn(len(SPLITS), out_features, in_features, generator=generator).to(dtype).requires_grad_()


def _rowwise_reference(x, weights, splits):
    """Each row times the transpose of its own expert's weight, in float64: no grouping at all."""
    expert_of_row = torch.repeat_interleave(torch.arange(len(splits)), torch.tensor(splits))
    per_row = torch.stack([w.double() for w in weights])[expert_of_row]  # [rows, out, in]
    return torch.bmm(per_row, x.double().unsqueeze(-1)).squeeze(-1)


COUNTS = {"list": lambda: SPLITS, "tensor": lambda: torch.tensor(SPLITS)}  # how tokens_per_expert may come


@pytest.mark.parametrize("counts", COUNTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_grouped_mm_equals_each_row_times_its_expert(provider, dtype, counts):
    x = torch.randn(sum(SPLITS), 12, generator=torch.Generator().manual_seed(0)).to(dtype).requires_grad_()
    weight = _expert_weight(dtype)
    ref_x = x.detach().double().requires_grad_()
    ref_weights = [w.detach().double().requires_grad_() for w in weight.unbind(0)]
    out = provider.grouped_mm(x, weight, COUNTS[counts]())
    want = _rowwise_reference(ref_x, ref_weights, SPLITS)
    assert out.dtype == dtype and out.shape == want.shape
    torch.testing.assert_close(out.double(), want, **TOLERANCE[dtype])
    grad = torch.randn(want.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    out.backward(grad.to(dtype))
    want.backward(grad)
    torch.testing.assert_close(x.grad.double(), ref_x.grad, **TOLERANCE[dtype])
    assert weight.grad.shape == weight.shape
    for got, ref in zip(weight.grad, ref_weights):
        torch.testing.assert_close(got.double(), ref.grad, **TOLERANCE[dtype])
    assert torch.count_nonzero(weight.grad[1]) == 0


def test_grouped_mm_refuses_counts_for_another_number_of_experts(provider):
    with pytest.raises(ValueError, match=r"tokens_per_expert has 3 experts but the weight \(4, 8, 12\)"):
        provider.grouped_mm(torch.randn(6, 12), _expert_weight(torch.float32), [2, 2, 2])


def test_the_npu_grouped_matmul_is_what_runs_forward_and_backward(npu_kernels, torch_npu_double):
    """One grouped matmul forward, two backward (dx split M, dw split K): torch_npu's op has no autograd."""
    x = torch.randn(sum(SPLITS), 12, requires_grad=True)
    npu_kernels.grouped_mm(x, _expert_weight(torch.float32), torch.tensor(SPLITS)).sum().backward()
    assert torch_npu_double.CALLS["npu_grouped_matmul"] == 3


@pytest.mark.cuda
def test_the_cuda_grouped_gemm_equals_the_torch_loop_on_a_gpu():
    """torch's grouped GEMM (CUDA bfloat16, the stacked weight read in place, ``offs`` summed on the device
    from counts already there) against the torch provider's GEMM per expert: outputs and gradients."""
    from adapter.kernels import cuda_provider, torch_provider

    splits = torch.tensor([40, 0, 72, 16], device="cuda")
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(int(splits.sum()), 64, generator=generator).cuda().bfloat16()
    weight = torch.randn(len(splits), 32, 64, generator=generator).cuda().bfloat16()
    results = []
    for impl in (cuda_provider.grouped_mm, torch_provider.grouped_mm):
        leaf_x, leaf_w = x.clone().requires_grad_(), weight.clone().requires_grad_()
        out = impl(leaf_x, leaf_w, splits)
        out.backward(torch.ones_like(out))
        results.append((out, leaf_x.grad, leaf_w.grad))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, **TOLERANCE[torch.bfloat16])


def _experts_config(bias: bool):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=12, ffn_hidden_size=8, num_attention_heads=2,
                             num_moe_experts=len(SPLITS), moe_ffn_hidden_size=8, moe_router_topk=2,
                             moe_grouped_gemm=True, gated_linear_unit=True,
                             activation_func=torch.nn.functional.silu, add_bias_linear=bias,
                             bias_activation_fusion=False, bias_dropout_fusion=False,
                             use_cpu_initialization=True, hidden_dropout=0.0, cuda_graph_scope=[])


def _both_expert_layers(config):
    """megatron's SequentialMLP and the experts the local spec gives ``moe_grouped_gemm``, same weights."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP

    groups, experts = ProcessGroupCollection.use_mpu_process_groups(), config.num_moe_experts
    spec = get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=True)
    experts_entry = spec_entries.submodules_of(spec.submodules.mlp).experts
    grouped = spec_entries.build(experts_entry, experts, config, pg_collection=groups)
    sequential = SequentialMLP(experts, config, MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                              linear_fc2=RowParallelLinear), groups)
    with torch.no_grad():
        for i, expert in enumerate(sequential.local_experts):
            for name in ("linear_fc1", "linear_fc2"):
                ours, theirs = getattr(grouped, name), getattr(expert, name)
                ours.weight[i].copy_(theirs.weight)
                if config.add_bias_linear:
                    ours.bias[i].copy_(theirs.bias)
    return grouped, sequential


def _tokens_and_probs():
    generator = torch.Generator().manual_seed(3)
    return torch.randn(sum(SPLITS), 12, generator=generator), torch.rand(sum(SPLITS), generator=generator)


def test_grouped_experts_equal_megatrons_sequential_experts():
    """The spec's grouped experts (``TEGroupedMLP`` over the provider's grouped linear layers) and megatron's
    expert-by-expert SequentialMLP: the same outputs and gradients for the same weights and tokens."""
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    with one_rank_model_parallel():
        grouped, sequential = _both_expert_layers(_experts_config(bias=False))
        assert isinstance(grouped, TEGroupedMLP)
        tokens, probs = _tokens_and_probs()
        outputs = []
        for experts in (grouped, sequential):
            x = tokens.clone().requires_grad_()
            out, _ = experts(x, torch.tensor(SPLITS), probs)
            out.backward(torch.ones_like(out))
            outputs.append((out, x.grad))
        torch.testing.assert_close(outputs[0], outputs[1], **TOLERANCE[torch.float32])
        for i, expert in enumerate(sequential.local_experts):
            for name in ("linear_fc1", "linear_fc2"):
                torch.testing.assert_close(getattr(grouped, name).weight.grad[i],
                                           getattr(expert, name).weight.grad, **TOLERANCE[torch.float32])


def test_grouped_experts_with_biases_equal_megatrons_sequential_experts():
    """Biases (fc1's added per expert, fc2's weighted by the routing prob), forward only: megatron's own
    SequentialMLP cannot run backward with biases at TP1 x EP1 (its fc2 adds the bias in place into
    a view of the tensor-parallel reduce), on any device."""
    with one_rank_model_parallel():
        grouped, sequential = _both_expert_layers(_experts_config(bias=True))
        with torch.no_grad():
            for i in range(len(SPLITS)):
                for name in ("linear_fc1", "linear_fc2"):
                    getattr(grouped, name).bias[i].normal_()
                    getattr(sequential.local_experts[i], name).bias.copy_(getattr(grouped, name).bias[i])
            tokens, probs = _tokens_and_probs()
            got, want = (experts(tokens, torch.tensor(SPLITS), probs)[0] for experts in (grouped, sequential))
        torch.testing.assert_close(got, want, **TOLERANCE[torch.float32])


def test_grouped_experts_checkpoint_under_sequential_experts_keys():
    """Checkpoints are interchangeable: every sharded tensor has SequentialMLP's key, shape and global
    offset, so one layout's checkpoint loads into the other (SequentialMLP's extra states, empty, aside)."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.mapping import apply_factories
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    with one_rank_model_parallel():
        grouped, sequential = _both_expert_layers(_experts_config(bias=True))

        def layout(experts):
            sharded = experts.sharded_state_dict(prefix="mlp.")
            apply_factories(sharded)  # fc1's gated halves become their own tensors
            return sorted((t.key, tuple(t.local_shape), tuple(t.global_offset))
                          for t in nested_values(sharded) if isinstance(t, ShardedTensor))

        mine = layout(grouped)
        assert {key for key, _, _ in mine} == {f"mlp.experts.{n}.{p}" for n in ("linear_fc1", "linear_fc2")
                                              for p in ("weight", "bias")}
        assert len(mine) == 6 * len(SPLITS)  # per expert: fc1's weight and bias in two gated halves, fc2's
        assert mine == layout(sequential)


def test_each_expert_projection_is_one_parameter():
    """qwen3-moe-tiny with ``moe_grouped_gemm``: every MoE layer's experts are two parameters, fc1 [experts,
    2 x ffn, hidden] and fc2 [experts, hidden, ffn], where megatron's SequentialMLP has two per expert; the
    model's size is unchanged (the flavor's own count, which megatron's SequentialMLP build matches)."""
    import models
    from models.provider import build_model, transformer_config

    model = models.get("qwen3-moe-tiny")
    with one_rank_model_parallel(), torch.device("meta"):
        gpt = build_model(model, transformer_config(model, perform_initialization=False, moe_grouped_gemm=True))
    for layer in gpt.decoder.layers:
        experts = dict(layer.mlp.experts.named_parameters())
        assert {name: tuple(p.shape) for name, p in experts.items()} == {
            "linear_fc1.weight": (model.num_experts, 2 * model.moe_ffn_hidden_size, model.hidden_size),
            "linear_fc2.weight": (model.num_experts, model.hidden_size, model.moe_ffn_hidden_size)}
    assert sum(p.numel() for p in gpt.parameters()) == model.num_parameters()


def _sharded_without_extra_states(experts, prefix: str = "mlp.") -> dict:
    """The experts' sharded state dict less SequentialMLP's (empty) extra states, which the grouped
    layout has no counterpart for."""
    sharded = experts.sharded_state_dict(prefix=prefix)
    return {key: value for key, value in sharded.items() if not key.endswith("_extra_state")}


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_a_checkpoint_moves_between_grouped_and_sequential_experts(tmp_path, bias):
    """Saved with dist_checkpointing from one layout and loaded into the other, built from another seed:
    the loaded experts give the saver's outputs exactly, both ways."""
    from megatron.core import dist_checkpointing
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    with one_rank_model_parallel():
        config = _experts_config(bias=bias)
        saver = dict(zip(("grouped", "sequential"), _both_expert_layers(config)))
        model_parallel_cuda_manual_seed(99)  # the loaders start from other weights
        loader = dict(zip(("grouped", "sequential"), _both_expert_layers(config)))
        tokens, probs = _tokens_and_probs()
        with torch.no_grad():
            for experts in (*saver.values(), *loader.values()):  # biases start at zero: make them count
                for name, param in experts.named_parameters():
                    if "bias" in name:
                        param.normal_()
            for source, target in (("grouped", "sequential"), ("sequential", "grouped")):
                directory = tmp_path / f"{source}_to_{target}"
                directory.mkdir()
                want = saver[source](tokens, torch.tensor(SPLITS), probs)[0]
                assert not torch.equal(loader[target](tokens, torch.tensor(SPLITS), probs)[0], want)
                dist_checkpointing.save(_sharded_without_extra_states(saver[source]), str(directory))
                state = dist_checkpointing.load(_sharded_without_extra_states(loader[target]), str(directory))
                missing, unexpected = loader[target].load_state_dict(
                    {key.removeprefix("mlp."): value for key, value in state.items()}, strict=False)
                assert not unexpected and all(key.endswith("_extra_state") for key in missing)
                torch.testing.assert_close(loader[target](tokens, torch.tensor(SPLITS), probs)[0], want,
                                           rtol=0, atol=0)


def test_a_plain_state_dict_of_per_expert_weights_still_loads():
    """``weight{i}`` / ``bias{i}`` per local expert, as the grouped experts' plain state dicts held them
    before one parameter per projection, load into the stacked parameters."""
    with one_rank_model_parallel():
        grouped, sequential = _both_expert_layers(_experts_config(bias=True))
        fc2 = grouped.linear_fc2
        old = {f"{name}{i}": getattr(expert.linear_fc2, name).detach() + 1
               for i, expert in enumerate(sequential.local_experts) for name in ("weight", "bias")}
        fc2.load_state_dict(old)
        for i, expert in enumerate(sequential.local_experts):
            assert torch.equal(fc2.weight[i], expert.linear_fc2.weight + 1)
            assert torch.equal(fc2.bias[i], expert.linear_fc2.bias + 1)


def test_grouped_experts_initialise_on_the_device_from_the_expert_rng():
    """With ``use_cpu_initialization=False`` (the flow's setting on an accelerator) each local expert is
    drawn in place on the device from the expert-parallel RNG, as megatron's device initialisation of
    expert weights: init_method's std, distinct experts, the default RNG stream untouched, and megatron's
    tensor-parallel attributes set once (megatron asserts they are not set twice)."""
    import dataclasses

    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    from adapter import device

    with one_rank_model_parallel():
        config = dataclasses.replace(_experts_config(bias=False), use_cpu_initialization=False)
        default_stream = get_cuda_rng_tracker().get_states()
        grouped, _ = _both_expert_layers(config)
        weights = grouped.linear_fc1.weight  # [experts, out, in]: the sliced out dim is 1
        assert weights.device == device.torch_device()
        assert weights.tensor_model_parallel and weights.partition_dim == 1
        assert weights.std().item() == pytest.approx(config.init_method_std, rel=0.3)
        assert not torch.equal(weights[0], weights[1])
        assert torch.equal(get_cuda_rng_tracker().get_states()["model-parallel-rng"],
                           default_stream["model-parallel-rng"])


def _routing(tokens=6, experts=4, topk=2, seed=4):
    """A top-k routing map with the last expert left without tokens, and softmax probs."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=generator)
    logits[:, -1] = -1e9
    probs = logits.softmax(-1)
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter(1, logits.topk(topk).indices, True)
    hidden = torch.randn(tokens, 5, generator=generator)
    return hidden, probs * routing_map, routing_map


def _megatron_permute(tokens, routing_map, probs=None):
    """megatron's unfused ``permute``: (rows, row probs, row indices). 0.17+ asks for the row count (fixed
    shapes) and appends the pad offsets and per-expert counts, which an unpadded permutation leaves
    None / as given."""
    from megatron.core.transformer.moe.moe_utils import permute

    return permute(tokens, routing_map, probs=probs, num_out_tokens=int(routing_map.sum()))[:3]


def _dispatch_and_combine(permute_with_probs, unpermute, hidden, probs, routing_map, dtype):
    """What the alltoall dispatcher does around the experts: permute tokens and probs, weight each row by
    its prob (the experts do), unpermute. Returns the outputs and the gradients of tokens and probs."""
    x, p = hidden.to(dtype).requires_grad_(), probs.clone().requires_grad_()
    rows, row_probs, indices = permute_with_probs(x, p, routing_map)
    out = unpermute(rows * row_probs.unsqueeze(-1).to(dtype), indices, x.shape)
    (out.float() * torch.arange(out.shape[1])).sum().backward()
    return rows, row_probs, out, x.grad, p.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_permutation_equals_megatrons_unfused_permutation(provider, dtype):
    """Rows, their order, probs, the combined output and every gradient as megatron's own unfused
    ``permute`` / ``unpermute`` give them."""
    from megatron.core.transformer.moe.moe_utils import unpermute

    hidden, probs, routing_map = _routing()
    count = int(routing_map.sum())
    fused = _dispatch_and_combine(
        lambda x, p, m: provider.moe_permute.fused_permute_with_probs(x, p, m, count),
        lambda rows, rows_map, shape: provider.moe_permute.fused_unpermute(rows, rows_map, restore_shape=shape),
        hidden, probs, routing_map, dtype)
    unfused = _dispatch_and_combine(lambda x, p, m: _megatron_permute(x, m, probs=p), unpermute,
                                    hidden, probs, routing_map, dtype)
    for got, want in zip(fused, unfused):
        torch.testing.assert_close(got, want, **TOLERANCE[dtype])


def test_the_npu_permutation_is_torch_npus_index_form(npu_kernels, torch_npu_double):
    """A top-k map (every token k experts) goes through torch_npu's permute and unpermute; a map of uneven
    rows (what capacity dropping leaves) through the torch permutation, with the same result."""
    hidden, probs, routing_map = _routing()
    rows, _, indices = npu_kernels.moe_permute.fused_permute_with_probs(hidden, probs, routing_map)
    npu_kernels.moe_permute.fused_unpermute(rows, indices, restore_shape=hidden.shape)
    assert torch_npu_double.CALLS["npu_moe_token_permute"] == 1
    assert torch_npu_double.CALLS["npu_moe_token_unpermute"] == 1
    dropped = routing_map.clone()
    dropped[0] = False
    rows, indices = npu_kernels.moe_permute.fused_permute(hidden, dropped)
    from adapter.kernels import moe_permute

    torch.testing.assert_close(rows, moe_permute.fused_permute(hidden, dropped)[0], rtol=0, atol=0)
    assert torch_npu_double.CALLS["npu_moe_token_permute"] == 1


def test_unpermute_merges_probs_as_megatron_does():
    """``merging_probs`` (TE's interface; megatron's dispatchers weight rows in the experts instead) on the
    torch permutation: megatron's ``unpermute(probs=, routing_map=)``."""
    from megatron.core.transformer.moe.moe_utils import unpermute

    from adapter.kernels import moe_permute

    hidden, probs, routing_map = _routing()
    rows, row_map = moe_permute.fused_permute(hidden, routing_map)
    _, _, indices = _megatron_permute(hidden, routing_map)
    torch.testing.assert_close(
        moe_permute.fused_unpermute(rows, row_map, merging_probs=probs, restore_shape=hidden.shape),
        unpermute(rows, indices, hidden.shape, probs=probs, routing_map=routing_map), **TOLERANCE[torch.float32])


def test_the_npu_permutation_refuses_merging_probs_by_name(npu_kernels):
    from adapter.kernels import UnsupportedKernelSetting

    hidden, probs, routing_map = _routing()
    rows, indices = npu_kernels.moe_permute.fused_permute(hidden, routing_map)
    with pytest.raises(UnsupportedKernelSetting, match="merging probs on the npu provider"):
        npu_kernels.moe_permute.fused_unpermute(rows, indices, merging_probs=probs, restore_shape=hidden.shape)


def test_fused_permutation_without_probs_and_chunk_sorting_equal_megatrons(provider):
    from megatron.core.transformer.moe.moe_utils import sort_chunks_by_idxs, unpermute

    hidden, _, routing_map = _routing()
    rows, indices = provider.moe_permute.fused_permute(hidden, routing_map, int(routing_map.sum()))
    want_rows, _, want_indices = _megatron_permute(hidden, routing_map)
    torch.testing.assert_close(rows, want_rows, rtol=0, atol=0)
    torch.testing.assert_close(provider.moe_permute.fused_unpermute(rows, indices, restore_shape=hidden.shape),
                               unpermute(want_rows, want_indices, hidden.shape), **TOLERANCE[torch.float32])
    splits, order, probs = torch.tensor([2, 0, 3, 1]), torch.tensor([2, 0, 3, 1]), torch.rand(6)
    got = provider.moe_permute.fused_sort_chunks_by_index_with_probs(hidden, probs, splits, order)
    want = sort_chunks_by_idxs(hidden, splits, order, probs=probs)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def _spec_experts(**flags):
    """The experts class the local MoE spec builds with ``flags``."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    mlp = get_gpt_layer_local_spec(num_experts=4, **flags).submodules.mlp
    return spec_entries.module_of(spec_entries.submodules_of(mlp).experts)


def test_without_grouped_gemm_the_spec_keeps_megatrons_choice():
    """Only ``moe_grouped_gemm`` is answered by the provider: without it megatron's SequentialMLP stays."""
    from megatron.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP

    assert _spec_experts(moe_grouped_gemm=False) is SequentialMLP
    assert _spec_experts(moe_grouped_gemm=True) is TEGroupedMLP


@pytest.mark.skipif(spec_entries.SINCE_0_17, reason="megatron-core 0.17 removed the legacy GroupedMLP and "
                                                       "its moe_use_legacy_grouped_gemm flag")
def test_with_the_legacy_flag_the_spec_keeps_megatrons_grouped_mlp():
    """megatron 0.16's legacy flag keeps megatron's own GroupedMLP (which needs the grouped_gemm package)."""
    from megatron.core.transformer.moe.experts import GroupedMLP

    with pytest.warns(UserWarning, match="legacy GroupedMLP"):
        assert _spec_experts(moe_grouped_gemm=True, moe_use_legacy_grouped_gemm=True) is GroupedMLP

"""No host syncs in the MoE token path (GPU issue 26): on a device, every op whose output size or value the
host must read back (``nonzero``, ``masked_select``, ``.item()``, ``.tolist()`` ...) stalls the host until the
device catches up. Counted here on the CPU, where nothing stalls, by the ops a device run would sync on, in
one forward and backward of megatron's MoE layer (all-to-all dispatcher, grouped GEMM, 1 rank); outputs and
gradients held to the same layer on megatron's unfused permutation."""

from __future__ import annotations

import collections
import contextlib
import traceback
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import adapter  # before megatron
from tests import spec_entries
from tests.kernel_reference import TOLERANCE, one_rank_model_parallel

# aten ops whose output size or value the host reads from the device
SYNCING_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_dim",
               "unique_consecutive"}
SYNCING_METHODS = {"tolist", "numpy"}  # read a tensor's values on the host without dispatching an op
# what the fused path may still sync on, with why
ALLOWED = {
    ("event wait", "dispatcher at before_finish"):
        "megatron's all-to-all dispatcher waits once per layer for its host copy of tokens_per_expert: the "
        "experts' grouped GEMM takes host row counts (TEGroupedMLP's tokens_per_expert.tolist())",
}


def _call_site() -> str:
    """The innermost frame outside torch and this file: where the syncing call is written."""
    for frame in reversed(traceback.extract_stack()):
        path = frame.filename.replace("\\", "/")
        if "/torch/" not in path and not path.endswith("test_moe_syncs.py"):
            return f"{path.rsplit('/', 1)[-1]}:{frame.name}"
    return "autograd engine"


def _indexes_by_mask(args) -> bool:
    """``aten.index`` / ``index_put`` with a bool index: the selected rows' count is read back."""
    indices = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
    return any(torch.is_tensor(i) and i.dtype == torch.bool for i in indices)


class SyncCounter(TorchDispatchMode):
    """Counts the syncing ops by (op, call site). Tensors in ``host`` are host memory on a device run too
    (megatron's own device-to-host copies): reading them syncs nothing."""

    def __init__(self):
        super().__init__()
        self.syncs = collections.Counter()
        self.host: list[torch.Tensor] = []

    def is_host(self, tensor) -> bool:
        return any(tensor is t for t in self.host)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name.split("::")[-1]
        syncs = name in SYNCING_OPS and not self.is_host(args[0])
        syncs |= name == "repeat_interleave" and kwargs.get("output_size") is None and torch.is_tensor(args[0])
        syncs |= name.startswith("index") and _indexes_by_mask(args)
        if syncs:
            self.syncs[(name, _call_site())] += 1
        return func(*args, **kwargs)


class _HostReads(TorchFunctionMode):
    def __init__(self, counter: SyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in SYNCING_METHODS and not self.counter.is_host(args[0]):
            self.counter.syncs[(func.__name__, _call_site())] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting_syncs(monkeypatch):
    """A SyncCounter over the block, which also counts megatron's all-to-all dispatcher's waits for its
    device-to-host copies and marks those copies as host memory."""
    from megatron.core.transformer.moe import token_dispatcher

    counter = SyncCounter()
    dispatcher = token_dispatcher.MoEAlltoAllTokenDispatcher
    to_host, wait = token_dispatcher.maybe_move_tensor_to_cpu, dispatcher._maybe_dtoh_and_synchronize

    def host_copy(tensor, as_numpy=False, record_stream=False):
        if not torch.is_tensor(tensor):
            return to_host(tensor, as_numpy, record_stream)
        copy = tensor.clone()
        counter.host.append(copy)
        return copy.numpy() if as_numpy else copy

    def waiting(self, point, tokens_per_expert=None):
        if point == self.cuda_sync_point and not self.drop_and_pad:
            counter.syncs[("event wait", f"dispatcher at {point}")] += 1
        return wait(self, point, tokens_per_expert)

    monkeypatch.setattr(token_dispatcher, "maybe_move_tensor_to_cpu", host_copy)
    monkeypatch.setattr(dispatcher, "_maybe_dtoh_and_synchronize", waiting)
    with _HostReads(counter), counter:
        yield counter


def _moe_layer(fusion: bool):
    """megatron's MoELayer from the local spec: 4 experts, top-2, all-to-all, grouped GEMM, aux loss."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=1, hidden_size=16, ffn_hidden_size=32, num_attention_heads=2, num_moe_experts=4,
        moe_ffn_hidden_size=8, moe_router_topk=2, moe_grouped_gemm=True, moe_permute_fusion=fusion,
        moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        use_cpu_initialization=True, hidden_dropout=0.0, bias_dropout_fusion=False, cuda_graph_scope=[])
    spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=True)
    torch.manual_seed(0)
    return spec_entries.build(spec.submodules.mlp, config=config, layer_number=1,
                              pg_collection=ProcessGroupCollection.use_mpu_process_groups())


def _forward_backward(layer, x):
    """Output and the gradients of input and parameters for a fixed projection of the output."""
    x = x.clone().requires_grad_()
    out, _ = layer(x)
    (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(2))).sum().backward()
    return [out.detach(), x.grad] + [p.grad for p in layer.parameters()]


def _hidden():
    return torch.randn(6, 2, 16, generator=torch.Generator().manual_seed(1))


def test_the_fused_moe_token_path_syncs_only_where_megatron_must(monkeypatch):
    """With moe_permute_fusion one MoE layer's forward and backward sync once (megatron's dispatcher, for
    the experts' host row counts), with the outputs and gradients of megatron's unfused permutation."""
    with one_rank_model_parallel():
        fused, unfused = _moe_layer(fusion=True), _moe_layer(fusion=False)
        fused(_hidden())  # first call: whatever a layer sets up once is not per step
        with counting_syncs(monkeypatch) as counter:
            got = _forward_backward(fused, _hidden())
        assert dict(counter.syncs) == {key: 1 for key in ALLOWED}
        want = _forward_backward(unfused, _hidden())
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **TOLERANCE[torch.float32])


def test_the_counter_sees_megatrons_unfused_permutation_sync(monkeypatch):
    """What the flow ran before (moe_permute_fusion off): on megatron-core 0.16 the unfused permute
    masked_selects the tokens and the probs, each a sync on a device, on top of the dispatcher's wait; since
    0.17 it argsorts the map to the dispatcher's row count (fixed shapes), so only the wait is left."""
    with one_rank_model_parallel():
        layer = _moe_layer(fusion=False)
        with counting_syncs(monkeypatch) as counter:
            _forward_backward(layer, _hidden())
    want = {("event wait", "dispatcher at before_permutation_2"): 1}
    if not spec_entries.SINCE_0_17:
        want[("masked_select", "moe_utils.py:permute")] = 2
    assert dict(counter.syncs) == want


def test_at_one_rank_the_dispatcher_sorts_no_chunks():
    """TP x EP = 1: the chunks are the local experts in order, so the dispatcher keeps no order to sort by
    and megatron's ``sort_chunks_by_idxs`` hands the rows back as they are."""
    from megatron.core.transformer.moe import token_dispatcher

    with one_rank_model_parallel():
        dispatcher = _moe_layer(fusion=True).token_dispatcher
    assert dispatcher.sort_input_by_local_experts is None and dispatcher.restore_output_by_local_experts is None
    rows, probs = torch.randn(5, 3), torch.rand(5)
    kept = token_dispatcher.sort_chunks_by_idxs(rows, torch.tensor([2, 3]), None, probs=probs, fused=True)
    assert kept[0] is rows and kept[1] is probs


def _uneven_routing(tokens=7, experts=4, seed=5):
    """A map with 0 to 3 experts per token (what capacity dropping or the allgather dispatcher's local
    experts leave), the last expert without tokens, and probs."""
    generator = torch.Generator().manual_seed(seed)
    routing_map = torch.rand(tokens, experts, generator=generator) < 0.5
    routing_map[:, -1] = False
    return torch.randn(tokens, 5, generator=generator), torch.rand(tokens, experts, generator=generator), routing_map


def test_permutation_with_megatrons_count_is_megatrons_order_without_a_sync(provider, monkeypatch):
    """Given the count (megatron's ``num_out_tokens``), rows and probs come in megatron's unfused order for
    any map, without a syncing op."""
    from megatron.core.transformer.moe.moe_utils import permute

    hidden, probs, routing_map = _uneven_routing()
    count = int(routing_map.sum())
    if provider.NAME == "npu":
        pytest.skip("the npu provider reads each token's expert count on the host to choose torch_npu's op "
                    "(npu_moe_permute._topk_ids); its order is tested in test_moe_kernels.py")
    with counting_syncs(monkeypatch) as counter:
        rows, row_probs, _ = provider.moe_permute.fused_permute_with_probs(hidden, probs, routing_map, count)
    assert not counter.syncs
    # 0.17+ appends the pad offsets and per-expert counts
    want_rows, want_probs, _ = permute(hidden, routing_map, probs=probs, num_out_tokens=count)[:3]
    torch.testing.assert_close((rows, row_probs), (want_rows, want_probs), rtol=0, atol=0)


@pytest.mark.parametrize("splits", [[2, 0, 3, 1, 4, 0], [0, 0, 5, 0, 1, 2]])
def test_chunk_sort_is_megatrons_without_a_sync(splits, monkeypatch):
    """The chunk sort gathers by a row index computed from the sizes: megatron's split-and-concatenate
    order (empty chunks included), forward and backward, with no syncing op."""
    from megatron.core.transformer.moe.moe_utils import sort_chunks_by_idxs

    from adapter.kernels import moe_permute

    sizes, order = torch.tensor(splits), torch.tensor([3, 0, 5, 1, 4, 2])
    rows = torch.randn(sum(splits), 4, generator=torch.Generator().manual_seed(3))
    probs = torch.rand(sum(splits), generator=torch.Generator().manual_seed(4))
    results = []
    for sort in (moe_permute.fused_sort_chunks_by_index_with_probs,
                 lambda r, p, s, o: sort_chunks_by_idxs(r, s, o, probs=p)):
        x, p = rows.clone().requires_grad_(), probs.clone().requires_grad_()
        with counting_syncs(monkeypatch) as counter:
            out, out_probs = sort(x, p, sizes, order)
            (out.sum(dim=1) * torch.arange(out.shape[0]) + out_probs).sum().backward()
        results.append(((out, out_probs, x.grad, p.grad), dict(counter.syncs)))
    (got, syncs), (want, _) = results
    assert not syncs
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def _parsed(monkeypatch, backend: str, argv: list[str]):
    """``argv`` as megatron.training's parser, with the adapter's patches, reads it on ``backend``."""
    import types

    from megatron.training.arguments import parse_args

    monkeypatch.setattr(adapter, "current_backend", lambda: types.SimpleNamespace(name=backend))
    monkeypatch.setattr("sys.argv", ["pretrain_gpt.py", *argv])
    return parse_args()


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
def test_moe_permute_fusion_keeps_megatron_lm_s_default_off_unless_asked_for(monkeypatch, backend):
    """megatron.training's --moe-permute-fusion defaults off on every backend and has no --no- form: Megatron-LM's
    meaning, kept (the earlier loop turned it on on CUDA). Where a GPU runs MoE, the flow's benches and the
    cluster scripts ask for it, as Megatron-LM's MoE recipes do."""
    assert _parsed(monkeypatch, backend, []).moe_permute_fusion is False
    assert _parsed(monkeypatch, backend, ["--moe-permute-fusion"]).moe_permute_fusion is True
    monkeypatch.setenv("ADAPTER_BACKEND", backend)
    from bench import moe

    assert ("--moe-permute-fusion" in moe._flow_argv(1, 1)) == (backend == "cuda")
    scripts = sorted(Path(__file__).resolve().parent.parent.glob("scripts/pretrain_*.sh"))
    cluster_moe = [path for path in scripts if "--expert-model-parallel-size" in path.read_text()
                   and "tiny" not in path.name]  # the tiny demo runs on a CPU too
    assert len(cluster_moe) >= 4 and all("--moe-permute-fusion" in path.read_text() for path in cluster_moe)

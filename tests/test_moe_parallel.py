"""megatron-core's MoE GPT trained on real gloo ranks after ``import adapter`` (rank functions in tests/moe_ranks.py):
expert parallelism gives the single-process loss curve, with either token dispatcher and under TP x EP with
sequence parallelism, and the router's features train and compute what their definitions say.

Layout equality holds for every load-balancing loss megatron computes per micro-batch (aux_loss, seq_aux_loss,
z-loss): the same micro-batches meet the same routers at any layout, and the schedule scales their gradients
by 1 / micro-batches per rank, which DDP's mean over the data-parallel ranks makes 1 / global micro-batches
again. ``global_aux_loss`` is left out of it on purpose: megatron averages its expert counts over the
micro-batches each rank has run so far in the step, summed over the data-parallel ranks, so micro-batch j at
EP2 is balanced against another set of tokens than at EP1 (measured: 3e-5 apart at coefficient 1e-2 after one
step, 5e-3 at 1.0). That is megatron's definition, not a device difference.
"""

from __future__ import annotations

import math

import pytest
import torch
from packaging.version import Version

from adapter.registry import installed_megatron_core_version
from scripts.train_tiny_gpt import Run
from tests.distributed import run_ranks
from tests.grouped_experts_ranks import optimizer_round_trip, sharded_layouts
from tests.moe_ranks import MOE, MoeRun, train

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

DISPATCHERS = ("alltoall", "allgather")
# the micro-batch load-balancing losses, all at once: their gradients are part of every compared step
BALANCED = (("moe_router_load_balancing_type", ["aux_loss", "seq_aux_loss"]), ("moe_aux_loss_coeff", [1e-2, 1e-3]),
            ("moe_z_loss_coeff", 1e-3))
EXPERTS, TOPK = MOE["num_moe_experts"], MOE["moe_router_topk"]
TOKENS = 2 * 32  # a micro-batch: 2 sequences of 32


# megatron's experts one by one (SequentialMLP), and the provider's grouped GEMM with fused permutation
EXPERTS_PATHS = {"": (), "+grouped": (("moe_grouped_gemm", True), ("moe_permute_fusion", True))}
CURVES = [f"{dispatcher}{path}" for dispatcher in DISPATCHERS for path in EXPERTS_PATHS]


def _curves(ep: int, run: Run = MoeRun.run) -> dict[str, MoeRun]:
    return {f"{dispatcher}{path}": MoeRun(run, ep, (("moe_token_dispatcher_type", dispatcher), *BALANCED, *flags))
            for dispatcher in DISPATCHERS for path, flags in EXPERTS_PATHS.items()}


def _feature(*settings, dispatcher="alltoall") -> MoeRun:
    return MoeRun(Run(steps=3, distributed_optimizer=True), 2, (("moe_token_dispatcher_type", dispatcher), *settings))


FEATURES = {
    "aux and z-loss": _feature(("moe_aux_loss_coeff", 1e-2), ("moe_z_loss_coeff", 1e-3)),
    "seq_aux_loss": _feature(("moe_router_load_balancing_type", "seq_aux_loss"), ("moe_aux_loss_coeff", 1e-2)),
    "global_aux_loss": _feature(("moe_router_load_balancing_type", "global_aux_loss"), ("moe_aux_loss_coeff", 1e-2)),
    "sigmoid with expert bias": _feature(("moe_router_score_function", "sigmoid"),
                                         ("moe_router_enable_expert_bias", True),
                                         ("moe_router_bias_update_rate", 1e-2),
                                         ("moe_router_topk_scaling_factor", 2.5)),
    "pre-softmax, scaled": _feature(("moe_router_pre_softmax", True), ("moe_router_topk_scaling_factor", 2.0)),
    "capacity, drop by probs": _feature(("moe_expert_capacity_factor", 1.0), ("moe_token_drop_policy", "probs")),
    "capacity, padded": _feature(("moe_expert_capacity_factor", 1.0), ("moe_pad_expert_input_to_capacity", True),
                                 ("moe_token_drop_policy", "position"), dispatcher="allgather"),
    "shared expert": _feature(("moe_shared_expert_intermediate_size", 64)),
    "gated shared expert": _feature(("moe_shared_expert_intermediate_size", 64), ("moe_shared_expert_gate", True)),
    "moe_layer_freq": _feature(("moe_layer_freq", [1, 0, 1, 0]), ("moe_aux_loss_coeff", 1e-2)),
}


def _losses(result: dict) -> list[float]:
    return [step["loss"] for step in result["steps"]]


@pytest.fixture(scope="module")
def ep1() -> dict:
    """One process: the dispatchers' loss curves at TP1 x EP1."""
    return {name: _losses(result) for name, result in run_ranks(1, train, _curves(1))[0].items()}


@pytest.fixture(scope="module")
def ep2() -> list[dict]:
    """Two processes at EP2 (DP2 for the dense weights): per rank, name -> what moe_ranks.train kept, for the
    dispatchers' curves and for each of FEATURES."""
    return run_ranks(2, train, {**_curves(2), **FEATURES})


def _max_gap(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.mark.parametrize("dispatcher", CURVES)
def test_expert_parallel_curve_equals_one_process(ep1, ep2, dispatcher):
    """EP2 (two processes, DDP and the distributed optimizer, each rank half the micro-batches) against EP1
    (one process, all of them): the same lm loss, step by step, with megatron's experts one by one and with
    the grouped GEMM and fused permutation."""
    curve = _losses(ep2[0][dispatcher])
    assert curve == _losses(ep2[1][dispatcher])
    assert _max_gap(curve, ep1[dispatcher]) < 1e-5, (curve, ep1[dispatcher])
    assert ep1[dispatcher][-1] < ep1[dispatcher][0] - 0.2, ep1[dispatcher]


@pytest.mark.parametrize("curve", ["alltoall", "alltoall+grouped"])
def test_tensor_and_expert_parallel_with_sequence_parallel_equal_one_process(ep1, curve):
    """TP2 x EP2 with sequence parallelism (four processes, all-to-all dispatcher): the TP ranks' tokens reach
    the experts through gathers of unequal pieces, as many as the router sent there; the experts are split
    over TP too (expert-TP 2), the grouped ones with each rank's slice of gate and up."""
    run = Run(steps=5, distributed_optimizer=True, tp=2, sequence_parallel=True)
    ranks = [_losses(rank[curve]) for rank in run_ranks(4, train, {curve: _curves(2, run)[curve]})]
    assert all(losses == ranks[0] for losses in ranks)
    assert _max_gap(ranks[0], ep1[curve]) < 1e-4, (ranks[0], ep1[curve])


# ------------------------------------------------------------------------------------ router features at EP2
def _calls(ep2, name: str, layer: int) -> list[list[dict]]:
    """The forward calls of ``layer``'s router in run ``name`` per step: rank 0's micro-batches, then rank 1's."""
    per_rank = [rank[name]["routing"][layer] for rank in ep2]
    per_step = len(per_rank[0]) // FEATURES[name].run.steps
    return [[call for calls in per_rank for call in calls[step * per_step:(step + 1) * per_step]]
            for step in range(FEATURES[name].run.steps)]


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1, tensor.shape[-1])


def _topk_mask(scores: torch.Tensor, k: int = TOPK) -> torch.Tensor:
    return torch.zeros_like(scores, dtype=torch.bool).scatter(-1, scores.topk(k, dim=-1).indices, True)


@pytest.mark.parametrize("name", FEATURES)
def test_each_feature_trains(ep2, name):
    losses = _losses(ep2[0][name])
    assert losses == _losses(ep2[1][name])
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0], losses


def _slot_share(logits: torch.Tensor) -> torch.Tensor:
    """f_i: the share of the T * k routing slots of T tokens that went to expert i."""
    return _topk_mask(logits).sum(dim=0) / (logits.shape[0] * TOPK)


def _balance_loss(logits: torch.Tensor, share: torch.Tensor | None = None) -> torch.Tensor:
    """The Switch Transformer's load-balancing loss (Fedus et al. 2021, eq. 4) with top-k routing as megatron
    documents it: E * sum_i f_i * P_i, P_i expert i's mean softmax probability over these tokens, f_i their
    ``_slot_share`` unless another one is given."""
    share = _slot_share(logits) if share is None else share
    return EXPERTS * (share * logits.softmax(dim=-1).mean(dim=0)).sum()


def _z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss (Zoph et al. 2022, eq. 5): the mean over tokens of logsumexp(logits) squared."""
    return logits.logsumexp(dim=-1).square().mean()


def test_softmax_top_k_probabilities_are_the_chosen_experts_renormalised(ep2):
    for step in _calls(ep2, "aux and z-loss", 1):
        for call in step:
            logits, chosen = _flat(call["logits"]), _topk_mask(_flat(call["logits"]))
            want = torch.where(chosen, logits.softmax(-1), 0.0)
            torch.testing.assert_close(call["probs"], want / want.sum(-1, keepdim=True))
            assert torch.equal(call["map"], chosen)


def test_pre_softmax_top_k_probabilities_are_scaled_not_renormalised(ep2):
    for call in _calls(ep2, "pre-softmax, scaled", 2)[0]:
        logits = _flat(call["logits"])
        torch.testing.assert_close(call["probs"], 2.0 * torch.where(_topk_mask(logits), logits.softmax(-1), 0.0))


def test_logged_aux_and_z_loss_per_layer_follow_their_definitions(ep2):
    """track_moe_metrics per layer: the load-balancing loss averaged over the global batch's micro-batches
    (megatron averages it over the data-parallel ranks); the z-loss over this rank's own micro-batches up to
    0.18 (megatron saves it without a group to reduce over), over the global batch's from 0.19 (it averages it
    over TP x DP x CP). megatron-core 0.16.1 logs no tokens-per-expert metric: the per-layer load reaches the
    log as the f_i of the load-balancing loss, the router's gating as its P_i and the z-loss of its logits."""
    z_over_all_ranks = Version(installed_megatron_core_version()) >= Version("0.19")
    for rank, result in enumerate(ep2):
        for i, step in enumerate(result["aux and z-loss"]["steps"]):
            balance, z = [], []
            for layer in range(1, 5):
                calls = _calls(ep2, "aux and z-loss", layer)[i]
                balance.append(torch.stack([_balance_loss(_flat(c["logits"])) for c in calls]).mean().item())
                z_calls = calls if z_over_all_ranks else calls[2 * rank:2 * rank + 2]
                z.append(torch.stack([_z_loss(_flat(c["logits"])) for c in z_calls]).mean().item())
                logged = step["logged"]
                assert logged[f"moe/load_balancing_loss_layer_{layer - 1}"] == pytest.approx(balance[-1], rel=1e-5)
                assert logged[f"moe/z_loss_layer_{layer - 1}"] == pytest.approx(z[-1], rel=1e-5)
            assert step["totals"]["load_balancing_loss"] == pytest.approx(sum(balance) / 4, rel=1e-5)
            assert step["totals"]["z_loss"] == pytest.approx(sum(z) / 4, rel=1e-5)


def test_logged_seq_aux_loss_is_the_balance_loss_of_each_sequence_averaged(ep2):
    """DeepSeek-V2's sequence-wise balance loss: the same formula over each sequence's tokens, averaged."""
    step = ep2[0]["seq_aux_loss"]["steps"][0]
    for layer in range(1, 5):
        calls = _calls(ep2, "seq_aux_loss", layer)[0]
        per_sequence = [_balance_loss(c["logits"][:, b]) for c in calls for b in range(c["logits"].shape[1])]
        want = torch.stack(per_sequence).mean().item()
        assert step["logged"][f"moe/seq_load_balancing_loss_layer_{layer - 1}"] == pytest.approx(want, rel=1e-5)


def test_logged_global_aux_loss_balances_against_the_load_so_far_in_the_global_batch(ep2):
    """The global-batch balance loss (Qiu et al. 2025, arXiv 2501.11873) as megatron accumulates it within a
    step: micro-batch j's probabilities over all data-parallel ranks against f_i averaged over the micro-batches
    1..j of all ranks; the mean over j is logged, the same on every rank."""
    for rank in ep2:
        for i, step in enumerate(rank["global_aux_loss"]["steps"]):
            for layer in range(1, 5):
                calls = _calls(ep2, "global_aux_loss", layer)[i]
                micro = [torch.cat([_flat(calls[j]["logits"]), _flat(calls[2 + j]["logits"])]) for j in range(2)]
                shares = [_slot_share(logits) for logits in micro]
                want = [_balance_loss(micro[j], torch.stack(shares[:j + 1]).mean(0)).item() for j in range(2)]
                logged = step["logged"][f"moe/global_load_balancing_loss_layer_{layer - 1}"]
                assert logged == pytest.approx(sum(want) / 2, rel=1e-5)


def test_sigmoid_routing_chooses_by_biased_score_and_the_bias_follows_the_load(ep2):
    """DeepSeek-V3's aux-loss-free balancing: experts chosen by sigmoid score + bias, weighted by their sigmoid
    scores renormalised (then scaled); after each step every bias moves by the update rate towards balance,
    up for an expert that got fewer tokens than the mean over the global batch, down for one that got more."""
    result = ep2[0]["sigmoid with expert bias"]
    for layer in range(1, 5):
        bias = torch.zeros(EXPERTS)
        for i, calls in enumerate(_calls(ep2, "sigmoid with expert bias", layer)):
            for call in calls:
                scores = _flat(call["logits"]).sigmoid()
                chosen = _topk_mask(scores + bias)
                torch.testing.assert_close(call["expert_bias"], bias)
                assert torch.equal(call["map"], chosen)
                want = torch.where(chosen, scores, 0.0)
                torch.testing.assert_close(call["probs"], 2.5 * want / want.sum(-1, keepdim=True))
            load = torch.stack([call["map"].sum(0) for call in calls]).sum(0).float()
            bias = bias + 1e-2 * torch.sign(load.mean() - load)
            torch.testing.assert_close(result["steps"][i]["expert_bias"][layer], bias)
        assert bias.abs().sum() > 0


def test_capacity_drops_the_least_probable_tokens_of_a_full_expert(ep2):
    """Capacity ceil(T * k / E * factor) per expert and micro-batch; the "probs" policy keeps, of the tokens
    routed to an expert, the most probable ones, and keeps their probabilities as they were."""
    capacity = math.ceil(TOKENS * TOPK / EXPERTS * 1.0)
    dropped = 0
    for step in _calls(ep2, "capacity, drop by probs", 1):
        for call in step:
            logits = _flat(call["logits"])
            routed = torch.where(_topk_mask(logits), logits.softmax(-1), 0.0)
            routed = routed / routed.sum(-1, keepdim=True)
            keep = torch.zeros_like(routed, dtype=torch.bool)
            for expert in range(EXPERTS):
                ranked = routed[:, expert].argsort(descending=True)[:capacity]
                keep[ranked[routed[ranked, expert] > 0], expert] = True
            assert torch.equal(call["map"], keep)
            torch.testing.assert_close(call["probs"], torch.where(keep, routed, 0.0))
            dropped += int(_topk_mask(logits).sum() - keep.sum())
    assert dropped > 0


def test_padded_capacity_gives_every_expert_exactly_its_capacity(ep2):
    capacity = math.ceil(TOKENS * TOPK / EXPERTS * 1.0)
    for step in _calls(ep2, "capacity, padded", 1):
        for call in step:
            assert call["map"].sum(0).tolist() == [capacity] * EXPERTS


def _swiglu(x: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor) -> torch.Tensor:
    gate, up = (x @ fc1.T).chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up) @ fc2.T


@pytest.mark.parametrize("name, gated", [("shared expert", False), ("gated shared expert", True)])
def test_shared_expert_is_a_swiglu_mlp_of_every_token_gated_by_a_sigmoid(ep2, name, gated):
    """The shared expert: a SwiGLU MLP every token passes through; gated, times sigmoid(x . w) per token."""
    for rank in ep2:
        assert sorted(rank[name]["shared"]) == [1, 2, 3, 4]
        for calls in rank[name]["shared"].values():
            for call in calls[:2]:  # the first step's micro-batches
                x = call["input"]
                want = _swiglu(x, call["linear_fc1.weight"], call["linear_fc2.weight"])
                if gated:
                    want = want * torch.sigmoid(x @ call["gate_weight"].T)
                assert ("gate_weight" in call) == gated
                torch.testing.assert_close(call["output"], want)


def test_moe_layer_freq_mixes_dense_and_moe_layers(ep2):
    result = ep2[0]["moe_layer_freq"]
    assert result["layers"] == ["MoELayer", "MLP", "MoELayer", "MLP"]
    assert sorted(result["routing"]) == [1, 3]
    logged = result["steps"][0]["logged"]
    per_layer = [logged[f"moe/load_balancing_loss_layer_{i}"] for i in range(4)]
    assert per_layer[1] == per_layer[3] == 0.0 and per_layer[0] > 0 and per_layer[2] > 0
    assert result["steps"][0]["totals"]["load_balancing_loss"] == pytest.approx((per_layer[0] + per_layer[2]) / 2)


# ------------------------------------------------------------------------- the grouped experts' checkpoints
def test_grouped_experts_checkpoint_as_megatrons_sequential_experts_at_ep2_tp2():
    """At EP2 x expert-TP2 (4 ranks), each rank's grouped experts (one parameter per projection, biased,
    gated) save exactly the tensors megatron's SequentialMLP saves there: keys, pieces, offsets in the
    global tensors, replicas. Per rank: 4 local experts (8 global) x (fc1 weight and bias in gate and up
    halves, fc2 weight and bias)."""
    ranks = run_ranks(4, sharded_layouts, 2, 2)
    for rank in ranks:
        assert rank["grouped"] == rank["sequential"]
        assert len(rank["grouped"]) == 4 * 6
    assert len({tuple(rank["grouped"]) for rank in ranks}) == 4


@pytest.mark.parametrize("sharding", ["dp_reshardable", "fully_reshardable"])
def test_grouped_experts_and_their_optimizer_state_come_back_bit_exact_at_ep2(tmp_path, sharding):
    """The distributed optimizer's checkpoint formats the flow uses, at EP2 with the grouped experts: it finds
    each expert parameter in the model's sharded state dict (a factory, by the parameter's identity), and a
    model and optimizer from another seed get every parameter and Adam state back bit for bit."""
    moe = MoeRun(Run(steps=2, distributed_optimizer=True), 2,
                 (("moe_grouped_gemm", True), ("moe_token_dispatcher_type", "alltoall")))
    for rank in run_ranks(2, optimizer_round_trip, moe, str(tmp_path), sharding):
        assert rank["differs_before"] and rank["params_equal"] and rank["optimizer_equal"]
        assert rank["expert_params"] == [f"module.decoder.layers.{layer}.mlp.experts.linear_fc{n}.weight"
                                         for layer in range(4) for n in (1, 2)]

"""Selective recompute of every module megatron accepts, without Transformer Engine (issue 43), on a tiny GPT
built by models/provider.py with the recompute settings in its TransformerConfig (``mla_up_proj``: a tiny
multi-latent attention GPT from megatron's local spec): the loss curve equals the curve without recompute,
and the activation bytes held for backward shrink where the module holds any.

megatron's recompute reruns the same ops on the same inputs with the same RNG states, so the curve is
bit-exact, except where recompute changes the ORDER in which autograd sums a tensor's gradients:
``shared_experts`` is checkpointed as a whole, so the shared expert's input gradient reaches the layer's
input (which the router and the routed experts also read) in another order, and float addition is not
associative: a last-bit difference (~1e-7 relative) in the update, never more.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_ranks
from tests.recompute_ranks import curves

pytestmark = pytest.mark.multiproc

BIT_EXACT = ["core_attn", "mlp", "moe", "moe_act", "layernorm"]  # and mla_up_proj, on an MLA GPT below
SUMMATION_ORDER = ["shared_experts"]


@pytest.fixture(scope="module")
def runs():
    """(losses, saved bytes) without recompute, with each module, and with all together: one process."""
    sets = [None, *([module] for module in BIT_EXACT + SUMMATION_ORDER), BIT_EXACT + SUMMATION_ORDER]
    results = run_ranks(1, curves, sets, env={"ADAPTER_BACKEND": "cpu"})[0]
    return dict(zip(["none", *BIT_EXACT, *SUMMATION_ORDER, "all"], results))


@pytest.mark.slow
@pytest.mark.parametrize("module", BIT_EXACT)
def test_recomputing_the_module_gives_the_loss_curve_of_no_recompute_bit_for_bit(runs, module):
    assert runs[module][0] == runs["none"][0]


@pytest.mark.slow
@pytest.mark.parametrize("module", [*SUMMATION_ORDER, "all"])
def test_recomputing_shared_experts_changes_the_curve_only_in_the_last_bits(runs, module):
    assert runs[module][0] == pytest.approx(runs["none"][0], rel=2e-7, abs=0)


@pytest.mark.slow
@pytest.mark.parametrize("module", ["mlp", "moe", "moe_act", "layernorm", "shared_experts", "all"])
def test_recompute_holds_fewer_activation_bytes_for_backward(runs, module):
    assert runs[module][1] < runs["none"][1]


@pytest.fixture(scope="module")
def mla_runs():
    """``mla_up_proj`` (MLA's q/kv up projections and RoPE, megatron's fused entry points, recomputed from the
    compressed q/kv and their outputs discarded) on a 2-layer MLA GPT, and the same without recompute."""
    return run_ranks(1, curves, [None, ["mla_up_proj"]], 3, True, env={"ADAPTER_BACKEND": "cpu"})[0]


@pytest.mark.slow
def test_recomputing_mla_up_proj_gives_the_losses_and_gradients_of_no_recompute_bit_for_bit(mla_runs):
    (losses, _, grads), (recomputed_losses, _, recomputed_grads) = mla_runs
    assert recomputed_losses == losses
    assert len(grads) == len(recomputed_grads) and all(map(torch.equal, recomputed_grads, grads))


@pytest.mark.slow
def test_recomputing_mla_up_proj_holds_fewer_activation_bytes_for_backward(mla_runs):
    """What it frees depends on what the attention kernel keeps: its RoPE's cos/sin always, and the q, k, v it
    discards where the kernel saves them as given (CPU SDPA's math path keeps scaled copies of q and k)."""
    assert mla_runs[1][1] < mla_runs[0][1]

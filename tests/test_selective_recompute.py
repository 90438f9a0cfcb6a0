"""Selective recompute of every module megatron accepts, without Transformer Engine (issue 43), on a tiny GPT
built by models/provider.py with the recompute settings in its TransformerConfig: the loss curve equals the
curve without recompute, and the activation bytes held for backward shrink where the module holds any.

megatron's recompute reruns the same ops on the same inputs with the same RNG states, so the curve is
bit-exact, except where recompute changes the ORDER in which autograd sums a tensor's gradients:
``shared_experts`` is checkpointed as a whole, so the shared expert's input gradient reaches the layer's
input (which the router and the routed experts also read) in another order, and float addition is not
associative: a last-bit difference (~1e-7 relative) in the update, never more.
"""

from __future__ import annotations

import pytest

from tests.distributed import run_ranks
from tests.recompute_ranks import curves

pytestmark = pytest.mark.multiproc

BIT_EXACT = ["core_attn", "mlp", "moe", "moe_act", "layernorm"]
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

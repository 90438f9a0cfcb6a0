"""Fine-grained activation offloading (``--fine-grained-activation-offloading``) off CUDA, through megatron-core
directly: megatron's offload manager saves the chosen modules' inputs to host memory after their forward and
copies them back before their backward, on the backend's streams (the CPU's one stream: the copies in place).
The tiny GPT in DDP with the distributed optimizer trains the loss curve of the same run without offloading,
at DP2 on torch's kernels and TP2 x DP2 on the npu provider's (the torch_npu double), while megatron's manager
reports the bytes it offloaded."""

from __future__ import annotations

import pytest
import torch

import adapter  # noqa: F401 - routing and the patch table before megatron
from adapter import activation_offload, host_memory
from scripts.train_tiny_gpt import Run
from tests.conftest import DOUBLES
from tests.distributed import run_ranks
from tests.activation_offload_ranks import train

MODULES = ["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm"]


def test_activations_on_this_backend_are_offloaded_and_parameters_and_host_copies_are_not():
    activation = torch.ones(4)
    assert activation_offload.can_manage(activation)
    assert not activation_offload.can_manage(torch.nn.Parameter(torch.ones(4)))
    assert not activation_offload.can_manage(activation.as_subclass(host_memory.HostCopy))


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("tp, kernels", [(1, "torch"), (2, "npu")])
def test_offloading_activations_trains_the_curve_of_the_run_without_it(tp, kernels):
    env = {"ADAPTER_KERNELS": "npu", "PYTHONPATH": str(DOUBLES)} if kernels == "npu" else None
    run = Run(tp=tp, steps=10)
    reference, offloaded = run_ranks(2 * tp, train, run, None, env=env), run_ranks(2 * tp, train, run, MODULES, env=env)
    for ref, off in zip(reference, offloaded):
        assert len(off["losses"]) == 10
        assert max(abs(a - b) for a, b in zip(ref["losses"], off["losses"])) <= 1e-5
        assert off["offloaded_bytes"] > 0 and ref["offloaded_bytes"] == 0


def test_megatron_lm_te_only_check_is_answered_without_transformer_engine():
    """Megatron-LM's validate_args asserts TE's spec for the flag; without TE the local spec runs it, so the
    check sees the flag off for the call and the flag is back on after."""
    import argparse

    from patches.activation_offload import offloading_without_transformer_engine

    def megatron_lm_check(args):  # arguments.py, core_v0.19.0
        assert not args.fine_grained_activation_offloading or args.transformer_impl == "transformer_engine"
        return "validated"

    validate = offloading_without_transformer_engine(megatron_lm_check)
    args = argparse.Namespace(fine_grained_activation_offloading=True, transformer_impl="local",
                              offload_modules=["core_attn"], rank=1)
    assert validate(args) == "validated" and args.fine_grained_activation_offloading

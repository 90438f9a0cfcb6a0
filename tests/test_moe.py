"""MoE on every backend (issue 15): megatron-core's own MoE code, after ``import adapter``, without
Transformer Engine: the router's gating GEMM, what the all-to-all dispatcher needs on the CPU (its host-copy
stream, gathers of unequal pieces on gloo), and on the npu backend no MoE code reaching the real torch.cuda.
Training at EP2 and TP2 x EP2 on gloo ranks: tests/test_moe_parallel.py."""

import json
import os
import subprocess
import sys

import pytest
import torch
from packaging.version import Version

import adapter  # before megatron
from adapter import registry
from adapter.registry import installed_megatron_core_version
from tests.distributed import ROOT, free_port

# the overlapped shared experts' streams in the 4-layer MoE GPT: one each, until megatron-core 0.18 made them
# share one
SHARED_EXPERT_STREAMS = 1 if Version(installed_megatron_core_version()) >= Version("0.18") else 4


def _have_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(_have_transformer_engine(), reason="with Transformer Engine megatron binds te_general_gemm")
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_the_router_gating_gemm_runs_without_transformer_engine(with_bias):
    """megatron leaves ``te_general_gemm`` unbound (0.16) or None (0.17+) without TE; bound to None, the gating GEMM is
    megatron's torch fallback: the same logits and gradients as a plain ``F.linear`` in fp32."""
    from megatron.core.transformer.moe.moe_utils import router_gating_linear

    assert registry.status("megatron.core.transformer.moe.moe_utils:te_general_gemm") == "applied"
    generator = torch.Generator().manual_seed(0)
    inp = torch.randn(2, 3, 8, generator=generator, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(4, 8, generator=generator, dtype=torch.bfloat16, requires_grad=True)
    bias = torch.randn(4, generator=generator, dtype=torch.bfloat16, requires_grad=True) if with_bias else None
    logits = router_gating_linear(inp, weight, bias, torch.float32)
    ref_inp, ref_weight = inp.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    ref_bias = bias.detach().float().requires_grad_() if with_bias else None
    want = torch.nn.functional.linear(ref_inp, ref_weight, ref_bias)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, want)
    grad = torch.randn(want.shape, generator=generator)
    logits.backward(grad)
    want.backward(grad)
    torch.testing.assert_close(inp.grad.float(), ref_inp.grad, atol=2e-2, rtol=2e-2)  # bf16 grads
    torch.testing.assert_close(weight.grad.float(), ref_weight.grad, atol=2e-2, rtol=2e-2)


def _on_cpu() -> bool:
    return adapter.current_backend().name == "cpu"


@pytest.mark.skipif(not _on_cpu(), reason="the CPU's one stream is the device layer's only on cpu")
def test_the_all_to_all_dispatchers_host_copy_stream_is_the_cpus_one_stream():
    """What ``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize`` asks of the DtoH stream it makes with
    ``torch.cuda.Stream()``, through the ``torch.cuda`` megatron's module sees: it is the current stream, in
    and out of ``torch.cuda.stream(it)`` (so megatron ties no tensor to it with ``record_stream``, which
    torch cannot do on CPU), and the event it records is complete, so ``synchronize()`` returns."""
    from megatron.core.transformer.moe import token_dispatcher

    cuda = token_dispatcher.torch.cuda
    stream = cuda.Stream()
    assert not cuda.current_stream() != stream
    with cuda.stream(stream):
        assert not cuda.current_stream() != stream
    event = stream.record_event()
    event.synchronize()
    assert event.query()
    assert stream.device == cuda.current_stream().device == torch.device("cpu")  # Megatron-FSDP asks it


def _gather_of_two_ranks(rank: int, pieces: list):
    """A stand-in for megatron's equal-size gather over two ranks: this rank's tensor and the other's, the
    other padded as the patch pads every rank's piece, concatenated in rank order."""
    longest = max(len(piece) for piece in pieces)

    def padded(piece):
        return torch.cat([piece, piece.new_zeros((longest - len(piece), *piece.shape[1:]))])

    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        assert output_split_sizes is None or len(set(output_split_sizes)) == 1
        return torch.cat([input_ if r == rank else padded(piece) for r, piece in enumerate(pieces)])

    return gather


@pytest.mark.skipif(not _on_cpu(), reason="gloo's gather only: NCCL and HCCL gather unequal pieces themselves")
@pytest.mark.parametrize("rank", [0, 1])
def test_unequal_pieces_gather_through_equal_ones(rank):
    """``mappings._gather_along_first_dim`` with unequal ``output_split_sizes`` (the all-to-all dispatcher's
    gather over TP): every rank's piece, at its own length, in rank order."""
    from megatron.core.tensor_parallel import mappings  # noqa: F401 - the patch applies on import

    from patches import moe

    assert registry.status("megatron.core.tensor_parallel.mappings:_gather_along_first_dim") == "applied"
    pieces = [torch.arange(6.0).reshape(3, 2), torch.arange(10.0, 20.0).reshape(5, 2)]
    gather = moe._gather_unequal_pieces_padded(_gather_of_two_ranks(rank, pieces))
    torch.testing.assert_close(gather(pieces[rank], None, [3, 5]), torch.cat(pieces))


# On the npu backend (torch_npu double, scripts/megatron_npu_stand_in.py for the device module, gloo as hccl):
# megatron's MoE layers are built with both dispatchers and an overlapped shared expert while every function of
# the real torch.cuda reports a megatron caller. The stand-in npu holds no tensors, so the forward stops at the
# first tensor put there; it must name the npu, not CUDA.
NPU_PROGRAM = r"""
import json, sys
import torch

sys.path.insert(0, "scripts")
import megatron_npu_stand_in

megatron_npu_stand_in.install(1)
streams = []


class Stream:  # torch_npu's stream as megatron's MoE code uses it, counted
    def __init__(self, *args, **kwargs):
        streams.append(self)

    def wait_stream(self, stream):
        pass


torch.npu.Stream = Stream
torch.npu.current_stream = lambda device=None: Stream()
reached = []


def tripwire(name, fn):
    def call(*args, **kwargs):
        if "/megatron/" in sys._getframe(1).f_code.co_filename:
            reached.append(f"torch.cuda.{name} from {sys._getframe(1).f_code.co_filename}")
        return fn(*args, **kwargs)
    return call


for name, value in list(vars(torch.cuda).items()):
    if not name.startswith("_") and callable(value) and not isinstance(value, type):
        setattr(torch.cuda, name, tripwire(name, value))

import adapter
from megatron.core import parallel_state
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
from tests.moe_ranks import MoeRun, build

adapter.init_distributed()
parallel_state.initialize_model_parallel(1, 1)
stopped = []
for settings in ((("moe_token_dispatcher_type", "alltoall"), ("moe_shared_expert_intermediate_size", 64),
                  ("moe_shared_expert_overlap", True)), (("moe_token_dispatcher_type", "allgather"),)):
    _, model = build(MoeRun(settings=settings), 1, 1)
    try:
        model(torch.zeros(2, 32, dtype=torch.long), torch.arange(32).expand(2, 32), None)
    except NotImplementedError as exc:
        stopped.append(str(exc).splitlines()[0][:80])
print("RESULT " + json.dumps({
    "backend": adapter.current_backend().name, "reached": reached, "streams": len(streams),
    "dtoh_stream": type(MoEAlltoAllTokenDispatcher.cuda_dtoh_stream).__name__, "stopped": stopped,
    "status": {p.target: adapter.registry.status(p.target) for p in adapter.registry.patches()
               if p.target.startswith(("megatron.core.transformer.moe", "megatron.core.tensor_parallel.mappings"))},
}))
"""


@pytest.mark.slow
def test_on_npu_megatron_moe_code_reaches_torch_npu_never_the_real_torch_cuda():
    env = {**os.environ, "ADAPTER_BACKEND": "npu", "WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "doubles"), str(ROOT)])}
    done = subprocess.run([sys.executable, "-c", NPU_PROGRAM], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert seen["backend"] == "npu" and seen["reached"] == []
    # the dispatcher's host-copy stream (one, shared) and the overlapped shared experts': torch.npu's
    assert (seen["dtoh_stream"], seen["streams"]) == ("Stream", 1 + SHARED_EXPERT_STREAMS)
    assert len(seen["stopped"]) == 2 and all("from the 'npu' backend" in s for s in seen["stopped"]), seen["stopped"]
    status = seen["status"]
    assert status["megatron.core.transformer.moe.moe_utils:te_general_gemm"] == "applied"
    assert status["megatron.core.tensor_parallel.mappings:_gather_along_first_dim"] == "not for npu"

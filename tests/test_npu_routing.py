"""On the npu backend, megatron's torch.cuda calls reach torch.npu and its groups get HCCL options.

No NPU here: a subprocess names torch's PrivateUse1 backend "npu" (as torch_npu does), registers a
recording stand-in for the ``torch.npu`` device module, and imports the torch_npu double, so backend
selection, the device layer and the patch table take their real npu paths.
"""

from tests.distributed import ROOT, run_program

PROGRAM = r"""
import json, sys, types
import torch

calls = []
npu = types.ModuleType("torch.npu")
npu.is_available = lambda: True
npu.device_count = lambda: 2
npu.current_device = lambda: 1
npu.set_device = lambda d: calls.append(("set_device", d))
npu.synchronize = lambda d=None: calls.append(("synchronize",))
npu.get_rng_state = lambda: calls.append(("get_rng_state",)) or torch.get_rng_state()
npu.set_rng_state = lambda s: calls.append(("set_rng_state",))
npu.manual_seed = lambda s: calls.append(("manual_seed", s))
torch.utils.rename_privateuse1_backend("npu")
torch._register_device_module("npu", npu)

import adapter
from adapter import torch_view
from megatron.core import parallel_state, timers
from megatron.core.pipeline_parallel import schedules
from megatron.core.tensor_parallel import random

status = {p.target: adapter.registry.status(p.target) for p in adapter.registry.patches()}
random._get_cuda_rng_state()
random.get_cuda_rng_tracker().add("probe", 7)
timers.torch.cuda.synchronize()
options = parallel_state.get_nccl_options("tp", {"tp": {"hccl_buffer_size": 400}})
print(json.dumps({
    "backend": adapter.current_backend().name,
    "dist_backend": adapter.current_backend().dist_backend,
    "status": status,
    "schedules_current_device": schedules.torch.cuda.current_device(),
    "cuda_routed": str(torch_view.route_device("cuda")),
    "cuda0_routed": str(torch_view.route_device("cuda:0")),
    "cpu_kept": str(torch_view.route_device("cpu")),
    "calls": calls,
    "hccl_config": options.hccl_config,
}))
"""


def test_megatron_cuda_calls_reach_torch_npu_and_groups_get_hccl_options():
    seen = run_program(PROGRAM, {"ADAPTER_BACKEND": "npu", "HCCL_BUFFSIZE": "250",
                                 "PYTHONPATH": str(ROOT / "tests" / "doubles")})
    assert (seen["backend"], seen["dist_backend"]) == ("npu", "hccl")
    status = seen["status"]
    assert status["megatron.core.parallel_state:get_nccl_options"] == "applied"
    assert status["megatron:*"] == "applied"  # every megatron module, by rule
    assert status["megatron.core.tensor_parallel.random:CudaRNGStatesTracker.fork"] == "not for npu"
    assert seen["schedules_current_device"] == 1
    assert (seen["cuda_routed"], seen["cuda0_routed"], seen["cpu_kept"]) == ("npu:1", "npu:0", "cpu")
    calls = [tuple(c) for c in seen["calls"]]
    assert ("get_rng_state",) in calls and ("manual_seed", 7) in calls
    assert ("set_rng_state",) in calls and ("synchronize",) in calls
    assert seen["hccl_config"] == {"hccl_buffer_size": 400, "group_name": "tp"}

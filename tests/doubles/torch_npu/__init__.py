"""A pure-PyTorch double of ``torch_npu`` for tests on machines without CANN or an NPU.

Written from ../shared/reference/torch_npu.md (read from the torch_npu wheels and Ascend's docs, not run on
NPU hardware): it models only the parts of torch_npu's API the adapter touches, with the behaviour that
reference records. It is importable only by tests that put ``tests/doubles`` on ``sys.path`` (the
``torch_npu_double`` fixture in tests/conftest.py, or a rank function that inserts the path itself), so
it never shadows a real torch_npu and ``import torch`` is unaffected.

What it deliberately does NOT do: register a ``torch.npu`` device module or the "hccl" backend. Importing
it therefore leaves ``adapter.backend.select_backend("npu")`` refusing ("imports but reports no NPU
device"), exactly as a torch_npu without a device would.

Layout (mirrors the real package; extend it here, one submodule per area):
- ``torch_npu._C._distributed_c10d.ProcessGroupHCCL.Options``: per-group HCCL options (``hccl_config``).
- ``torch_npu.npu_fusion_attention``, ``npu_rms_norm``, ``npu_swiglu``, ``npu_rotary_mul``,
  ``npu_cross_entropy_loss``, ``npu_scaled_masked_softmax``: the fused ops, top-level as on the real
  package, defined in ``torch_npu/_ops.py`` (pure torch, autograd-capable, validating the documented
  constraints; see that module for what is and is not modelled).
- The MoE ops, same module: ``npu_grouped_matmul`` (non-quantised; NO autograd, as the real op has no
  backward node), ``npu_moe_token_permute`` / ``npu_moe_token_unpermute`` (index form) and
  ``npu_moe_token_permute_with_routing_map`` / ``npu_moe_token_unpermute_with_routing_map`` (Megatron's
  permute / unpermute as ops), all four with autograd.
- The context-parallel ops, same module: ``npu_fusion_attention_grad`` (flash attention's backward from
  precomputed softmax statistics and output, as ring attention feeds it) and ``npu_ring_attention_update``
  (merges two partial attention results by their statistics; no autograd, as on the real package).
- ``torch_npu.CALLS``: a ``collections.Counter`` (double only) that each fused op increments under its own
  name on every call, refused calls included, so a test can prove a code path really dispatched to
  torch_npu (``CALLS["npu_fusion_attention"]``). It lives as long as the imported module: the
  ``torch_npu_double`` fixture re-imports the double per test, so each test starts from zero.
"""

__version__ = "0.0.0+double"
IS_DOUBLE = True  # lets a test tell the double from a real torch_npu

from torch_npu import _C  # noqa: E402,F401 - as on the real package, torch_npu._C is loaded on import
from torch_npu._ops import (  # noqa: E402,F401 - the real package exposes its fused ops at top level
    CALLS,
    npu_cross_entropy_loss,
    npu_fusion_attention,
    npu_fusion_attention_grad,
    npu_grouped_matmul,
    npu_moe_token_permute,
    npu_moe_token_permute_with_routing_map,
    npu_moe_token_unpermute,
    npu_moe_token_unpermute_with_routing_map,
    npu_ring_attention_update,
    npu_rms_norm,
    npu_rotary_mul,
    npu_scaled_masked_softmax,
    npu_swiglu,
)

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
"""

__version__ = "0.0.0+double"
IS_DOUBLE = True  # lets a test tell the double from a real torch_npu

from torch_npu import _C  # noqa: E402,F401 - as on the real package, torch_npu._C is loaded on import

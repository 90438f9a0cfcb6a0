"""Double of ``torch_npu._C`` (the compiled extension on the real package). See ``torch_npu/__init__.py``."""

from torch_npu._C import _distributed_c10d  # noqa: F401

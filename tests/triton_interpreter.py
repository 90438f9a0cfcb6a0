"""Liger-Kernel's Triton kernels on CPU tensors, through Triton's interpreter.

Triton decides when it is imported whether its kernels are interpreted (``TRITON_INTERPRET=1``), and
``import adapter`` imports it (torch.compile): tests/conftest.py sets the variable first, on machines
without an NVIDIA GPU. On a GPU machine the same tests run Liger's compiled kernels on the device.

Two things Triton's compiler does that Triton 3.7's interpreter does not are supplied inside
``compiler_semantics()``, both as the compiler does them; without them Liger's RMSNorm does not run:
- a Python float argument is a float32 scalar (the interpreter passes the float itself, so a kernel's
  ``eps.to(tl.float32)`` fails);
- libdevice's ``rsqrt``, a CUDA library call the interpreter has no stand-in for, is ``tl.math.rsqrt``.

The interpreter gets bfloat16 products wrong (a bf16 x bf16 product read back as float32 gives values
such as 1e26), so kernels are checked interpreted in float32 only; docs/CI.md lists what it cannot run.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util

INTERPRET_ENV = "TRITON_INTERPRET"


def liger_unavailable() -> str | None:
    """Why Liger's kernels cannot run here (a skip reason), or None."""
    if importlib.util.find_spec("triton") is None:
        return ("Triton is not installed: it comes with torch's CUDA build (pip install torch==2.13.0 on "
                "Python 3.12; the CPU build of 3.10/3.11 has none)")
    if importlib.util.find_spec("liger_kernel") is None:
        return "liger-kernel is not installed (the test extra brings it on Python >= 3.12)"
    return None


def interpreting() -> bool:
    import triton

    return bool(triton.knobs.runtime.interpret)


def _float_as_fp32(convert):
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    def implicit_cvt(arg):
        if isinstance(arg, float):
            return tl.tensor(interpreter.TensorHandle(np.array([arg], dtype=np.float32), tl.float32), tl.float32)
        return convert(arg)

    return implicit_cvt


def _interpreted_rsqrt(x):
    import triton.language as tl

    return tl.math.rsqrt(x)  # looked up per call: the interpreter patches tl.math while a kernel runs


@contextlib.contextmanager
def compiler_semantics():
    """Within: the interpreter takes float arguments and libdevice's rsqrt as Triton's compiler does."""
    from triton.runtime import interpreter

    rms_norm = importlib.import_module("liger_kernel.ops.rms_norm")
    convert, rsqrt = interpreter._implicit_cvt, rms_norm.rsqrt
    interpreter._implicit_cvt, rms_norm.rsqrt = _float_as_fp32(convert), _interpreted_rsqrt
    try:
        yield
    finally:
        interpreter._implicit_cvt, rms_norm.rsqrt = convert, rsqrt

"""The warnings the adapter has answered, kept from the user; every other warning still shows.

Without apex and Transformer Engine (every CPU and NPU machine, many GPU ones) megatron-core warns, from
every rank and several modules, that it falls back to torch norms, torch optimizers and local
multi-tensor ops. The adapter has answered each of these (its kernel provider's norms and kernels,
foreach multi-tensor ops, torch's Adam fused on CPU) and says once, on rank 0, what runs instead
(``adapter.report.kernel_summary``). Each row below is scoped to the module that warns and the exact
message. ``python -W ...`` / ``PYTHONWARNINGS`` (the user deciding) or ``ADAPTER_SHOW_ALL_WARNINGS=1``
installs none of them; ``python -m adapter`` lists them.
"""

from __future__ import annotations

import os
import sys
import warnings

SHOW_ALL_ENV = "ADAPTER_SHOW_ALL_WARNINGS"

# (action, message regex, category, module regex, why the user need not see it every time)
TABLE = (
    ("ignore", r"Transformer Engine and Apex are not installed\. Falling back to ", UserWarning, r"megatron\.",
     "megatron's fallback to torch optimizers and local multi-tensor ops: the adapter supplies foreach "
     "multi-tensor ops and says which optimizer runs"),
    ("ignore", r"Apex is not installed\. Falling back to Torch Norm", UserWarning, r"megatron\.",
     "megatron's fallback norm: the adapter's kernel provider supplies the norm module"),
    ("ignore", r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed", UserWarning,
     r"megatron\.core\.optimizer\.", "megatron's own zero_grad reading .grad of its fp32 shard views, which "
     "never have one: nothing is wrong"),
    ("ignore", r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated", FutureWarning,
     r"torch\.distributed\.", "megatron-core 0.16.1's DDP and distributed optimizer call these every step, on "
     "every rank; nothing a user can change (torch attributes them to its own wrapper, so this row is by message)"),
)


def installed() -> bool:
    """Whether the table is in force in this process: not when the user set warning filters themselves
    or asked for every warning."""
    return not sys.warnoptions and os.environ.get(SHOW_ALL_ENV, "").strip() not in ("1", "true", "yes")


def install() -> None:
    if installed():
        for action, message, category, module, _ in TABLE:
            warnings.filterwarnings(action, message=message, category=category, module=module)


def rows() -> list[dict]:
    """For the report: each row, and whether it is in force."""
    return [{"action": action, "message": message, "category": category.__name__, "module": module, "why": why,
             "in force": installed()} for action, message, category, module, why in TABLE]

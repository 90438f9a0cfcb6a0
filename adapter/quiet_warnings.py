"""The warnings the adapter has answered, or that do not apply to the run, kept from the user; every other
warning still shows.

Without apex and Transformer Engine (every CPU and NPU machine, many GPU ones) megatron-core warns, from
every rank and several modules, that it falls back to torch norms, torch optimizers and local
multi-tensor ops. The adapter has answered each of these (its kernel provider's norms and kernels,
foreach multi-tensor ops, torch's Adam fused on CPU) and says once, on rank 0, what runs instead
(``adapter.report.kernel_summary``). Other rows are notices about code the run does not use, or hints for a
device it is not on. Each row is scoped to the module that warns and the exact message: ``TABLE`` for the
``warnings`` module, ``LOGGED`` for ``logging`` records (a filter on the one logger that emits them). A row
with a ``where`` is in force only there: a hint that applies on CUDA is said there, once, by rank 0.
``python -W ...`` / ``PYTHONWARNINGS`` (the user deciding) or ``ADAPTER_SHOW_ALL_WARNINGS=1`` installs none
of them; ``python -m adapter`` lists them.

They are installed when the adapter is imported: in time for what megatron says at its import only where
``import adapter`` comes first (scripts/pretrain_gpt.py's first import).
"""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings
from typing import NamedTuple

SHOW_ALL_ENV = "ADAPTER_SHOW_ALL_WARNINGS"


def _off_cuda_rank_0() -> bool:
    """Everywhere but rank 0 of a CUDA run: where a CUDA hint does not apply, or another rank has said it."""
    from adapter import backend

    return backend.current().name != "cuda" or os.environ.get("RANK", "0") != "0"


WHERE = {"except on CUDA rank 0": _off_cuda_rank_0}


class Row(NamedTuple):
    action: str
    message: str  # regex, matched at the message's start
    category: type[Warning]
    module: str  # regex, matched at the start of the warning module's name
    why: str  # why the user need not see it every time
    where: str | None = None  # a key of WHERE: the row is in force there only; None: everywhere


class LoggedRow(NamedTuple):
    logger: str  # the exact logger that emits the record
    level: int
    message: str  # regex, matched at the start of the formatted message
    why: str


TABLE = (
    Row("ignore", r"Transformer Engine and Apex are not installed\. Falling back to ", UserWarning, r"megatron\.",
        "megatron's fallback to torch optimizers and local multi-tensor ops: the adapter supplies foreach "
        "multi-tensor ops and says which optimizer runs"),
    Row("ignore", r"Apex is not installed\. Falling back to Torch Norm", UserWarning, r"megatron\.",
        "megatron's fallback norm: the adapter's kernel provider supplies the norm module"),
    Row("ignore", r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed", UserWarning,
        r"megatron\.core\.optimizer\.", "megatron's own zero_grad reading .grad of its fp32 shard views, which "
        "never have one: nothing is wrong"),
    Row("ignore", r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated", FutureWarning,
        r"torch\.distributed\.", "megatron-core 0.16.1's DDP and distributed optimizer call these every step, on "
        "every rank; nothing a user can change (torch attributes them to its own wrapper, so this row is by message)"),
    Row("ignore", r"MimoModelConfig is experimental", UserWarning, r"megatron\.core\.models\.mimo\.",
        "megatron-core 0.19's get_megatron_optimizer imports its multimodal model on every rank only to ask whether "
        "the model is one, and that module's config class warns as it is defined; the run has no MiMo model"),
    Row("ignore", r"When using (sequence parallelism|async grad allreduce) it is recommended to set the environment "
        r"variable CUDA_DEVICE_MAX_CONNECTIONS to 1", UserWarning, r"megatron\.core\.tensor_parallel\.layers",
        "megatron's tensor-parallel linear layers ask for one CUDA hardware queue, so that their communication "
        "overlaps computation in order; the variable is the CUDA driver's and means nothing to a CPU or an NPU",
        where="except on CUDA rank 0"),
    Row("ignore", r"Only transformer-engine>=1\.7\.0 supports MoE experts, but your version is 0\.0\.0\.", UserWarning,
        r"megatron\.core\.extensions\.transformer_engine_spec_provider",
        "megatron.training's spec asks for grouped experts, dense models included, on every rank; 0.0.0 is what "
        "megatron reads where Transformer Engine is not installed at all (it runs the local experts, as it says; an "
        "installed TE older than 1.7 still shows)"),
    Row("ignore", r"'pin_memory' argument is set as true but no accelerator is found", UserWarning,
        r"torch\.utils\.data\.dataloader", "megatron.training's data loaders pin host memory for the copy to a "
        "GPU; a machine with no accelerator (the cpu backend) has no such copy to speed up"),
)

LOGGED = (
    LoggedRow("torch.utils.cpp_extension", logging.WARNING, r"No CUDA runtime is found, using CUDA_HOME=",
              "torch finds a CUDA toolkit but no GPU as megatron imports torch.utils.cpp_extension; it would "
              "matter to compiling CUDA extensions, and the run compiles none"),
    LoggedRow("megatron.core.distributed.distributed_data_parallel", logging.WARNING,
              r"DistributedDataParallel: full_param_layout not provided",
              "addressed to the code that builds megatron's DDP (the flow), not the user: megatron then computes "
              "the distributed optimizer's parameter layout itself, its path for callers that build DDP directly"),
    LoggedRow("megatron.core.dist_checkpointing.strategies.torch", logging.WARNING,
              r"MCore's async save is deprecated",
              "megatron-core's synchronous torch_dist save runs through its deprecated async path; the flow "
              "saves synchronously and asks for no async save"),
    LoggedRow("megatron.core.rerun_state_machine", logging.WARNING, r"RerunStateMachine initialized in mode",
              "said at every launch: the flow always sets megatron's rerun state machine up (--rerun-mode)"),
    LoggedRow("megatron.core.rerun_state_machine", logging.WARNING, r"Result validation enabled",
              "said at every launch once the loss is first checked (--check-for-nan-in-loss-and-grad is on by "
              "default)"),
    LoggedRow("megatron.core.rerun_state_machine", logging.WARNING,
              r"(Saving a checkpoint and exiting now|Exiting now\. A checkpoint at the last iteration is being)",
              "addressed to Megatron-LM's loop, which saves the machine's state to re-run the step on another GPU; "
              "the flow saves nothing after a rejected step and says so in its one error line"),
)


class _DropRecords(logging.Filter):
    """On the one logger it is added to: drops the records of ``level`` whose message starts as ``message``."""

    def __init__(self, level: int, message: str):
        super().__init__()
        self.level, self.message = level, re.compile(message)

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno == self.level and self.message.match(record.getMessage()))


def installed() -> bool:
    """Whether the table is in force in this process: not when the user set warning filters themselves
    or asked for every warning."""
    return not sys.warnoptions and os.environ.get(SHOW_ALL_ENV, "").strip() not in ("1", "true", "yes")


def install() -> None:
    if not installed():
        return
    for row in TABLE:
        if row.where is None or WHERE[row.where]():
            warnings.filterwarnings(row.action, message=row.message, category=row.category, module=row.module)
    for row in LOGGED:
        logging.getLogger(row.logger).addFilter(_DropRecords(row.level, row.message))


def rows() -> list[dict]:
    """For the report: each row, where it is in force, and whether the table is."""
    warned = [{"action": row.action, "message": row.message, "category": row.category.__name__,
               "module": row.module, "why": row.why, "where": row.where or "everywhere"} for row in TABLE]
    logged = [{"action": "ignore", "message": row.message, "category": f"logging.{logging.getLevelName(row.level)}",
               "module": row.logger, "why": row.why, "where": "everywhere"} for row in LOGGED]
    return [{**row, "in force": installed()} for row in warned + logged]

"""torch.compile's one-time question on the CPU, asked while a launch is still importing.

Before its first C++ build in a process, torch's inductor asks which vector instructions (AVX2, AVX-512, ...)
its builds may use: it builds and loads a small probe per candidate, each load in a subprocess (about 1.3 s
for the four candidates of an AVX-512 machine), and keeps the answer for the process. In the flow that
happens inside the first iteration, at the first compiled call (the torch provider's RMSNorm, megatron's
fused functions). An entry point asks for the question in a thread instead: the probes run in their
subprocesses beside the imports still to come, and the first compile finds torch's own cached answer.
Nothing is changed in what torch decides, only when it asks.

The earlier the better: scripts/pretrain_gpt.py sets ``ADAPTER_COMPILE_PROBE=1`` before it imports the
adapter, which starts the probe as soon as it knows the backend (before its patches and megatron-core are
imported, 2 s and more of imports; started after them, the entry waited 0.6 s for it). The adapter removes
the variable as it reads it, so the processes the program starts do not probe again.

The entry waits for the probe (``wait``) before megatron.training starts: a process forked without exec while
the probe starts its subprocess (megatron's data loader workers, multiprocessing's 'fork') inherits the pipe
Python's subprocess reads to learn that the child has exec'd, and the lock file inductor holds around the
probe. The probe then waits for good, and so does every process on the machine that compiles with the same
cache (seen twice on 2026-12-07: a test's ranks, and with them the rest of the suite, hung). The wait is not
an ``os.register_at_fork`` hook: filelock (which inductor's lock is) closes its locks' release during a fork
from its own hook, and a fork that waited there for the probe to release its lock never ended (seen the same
day).
"""

from __future__ import annotations

import os
import threading

import adapter

REQUEST = "ADAPTER_COMPILE_PROBE"


def start_if_requested() -> threading.Thread | None:
    """The probe, where this process's environment asks for it (``ADAPTER_COMPILE_PROBE=1``, removed here)."""
    if os.environ.pop(REQUEST, None) != "1":
        return None
    return probe_in_background()


def probe_in_background() -> threading.Thread | None:
    """Start inductor's vector-ISA probe in a daemon thread on the cpu backend; None elsewhere, or where
    this torch has no such probe (the compile then asks itself, as before)."""
    if adapter.current_backend().name != "cpu":
        return None
    try:
        from torch._inductor.cpu_vec_isa import valid_vec_isa_list
    except ImportError:
        return None
    thread = threading.Thread(target=valid_vec_isa_list, name="inductor-vec-isa-probe", daemon=True)
    thread.start()
    _started.append(thread)
    return thread


_started: list[threading.Thread] = []


def wait() -> None:
    """Return once the probe started here has finished: before anything forks this process."""
    while _started:
        _started.pop().join()

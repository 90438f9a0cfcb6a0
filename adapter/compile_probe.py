"""torch.compile's one-time question on the CPU, asked while a launch is still importing.

Before its first C++ build in a process, torch's inductor asks which vector instructions (AVX2, AVX-512, ...)
its builds may use: it builds and loads a small probe per candidate, each load in a subprocess (about 1 s
on the 2-core CI machine), and keeps the answer for the process. In the flow that happens inside the first
iteration, at the first compiled call (the torch provider's RMSNorm, megatron's fused functions). The
entry point (scripts/pretrain_gpt.py) starts the question in a thread instead, before it imports the flow:
the probes run in their subprocesses beside the imports, and the first compile finds torch's own cached
answer. Nothing is changed in what torch decides, only when it asks.

The entry point waits for the thread (``wait``) before megatron.training starts: a process forked without
exec while the probe starts its subprocess (megatron's data loader workers, multiprocessing's 'fork') inherits
the pipe Python's subprocess reads to learn that the child has exec'd, and the lock file inductor holds around
the probe. The probe then waits for good, and so does every process on the machine that compiles with the
same cache (seen twice on 2026-12-07: a test's ranks, and with them the rest of the suite, hung).
"""

from __future__ import annotations

import threading

import adapter


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

"""Launch real ranks for a test: fresh interpreters with torchrun's environment (gloo on the CPU backend).

``run_ranks(n, fn, *args)`` runs ``fn(*args)`` in n new Python processes (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT set as torchrun sets them) and returns each rank's return value. ``fn`` must be
a module-level function of an importable module. A failing rank's stderr is raised in the test; a rank
still running at the timeout is killed, so a broken collective fails the test instead of hanging it.

It and ``launch_ranks`` (every rank run to its own end, for tests of how ranks stop) are the suite's
launchers of multi-rank tests: every test that calls one is marked ``multiproc`` (tests/test_markers.py
checks the sources).
"""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class RankFailure(AssertionError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(world_size: int, fn, *args, env: dict | None = None, timeout: float = 600.0) -> list:
    with tempfile.TemporaryDirectory(prefix="ranks-") as tmp:
        tmp = Path(tmp)
        procs = _start(tmp, world_size, fn, args, env)
        deadline = time.monotonic() + timeout
        failed = None
        while any(p.poll() is None for p, _ in procs):
            failed = next((r for r, (p, _) in enumerate(procs) if p.poll() not in (None, 0)), None)
            if failed is not None or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        _stop(procs)
        if failed is None:
            failed = next((r for r, (p, _) in enumerate(procs) if p.returncode != 0), None)
        if failed is not None:
            tail = (tmp / f"rank{failed}.log").read_text()[-6000:]
            timed_out = time.monotonic() > deadline
            raise RankFailure(f"rank {failed} of {world_size} "
                              f"{'timed out' if timed_out else 'failed'} running {fn.__qualname__}:\n{tail}")
        return [pickle.loads((tmp / f"rank{r}.out").read_bytes()) for r in range(world_size)]


def launch_ranks(world_size: int, fn, *args, env: dict | None = None, timeout: float = 600.0) -> list[dict]:
    """As run_ranks, but every rank runs to its own end, failing or not: for tests of how each rank
    stops. Returns per rank ``{"status", "seconds", "log"}``; a rank still running at the timeout is killed
    (status None)."""
    with tempfile.TemporaryDirectory(prefix="ranks-") as tmp:
        tmp = Path(tmp)
        start = time.monotonic()
        procs = _start(tmp, world_size, fn, args, env)
        ended = [None] * world_size
        while any(p.poll() is None for p, _ in procs) and time.monotonic() < start + timeout:
            for rank, (p, _) in enumerate(procs):
                if p.poll() is not None and ended[rank] is None:
                    ended[rank] = time.monotonic() - start
            time.sleep(0.05)
        statuses = [p.poll() for p, _ in procs]
        _stop(procs)
        return [{"status": statuses[r], "seconds": ended[r] or time.monotonic() - start,
                 "log": (tmp / f"rank{r}.log").read_text()} for r in range(world_size)]


def _start(tmp: Path, world_size: int, fn, args: tuple, env: dict | None) -> list:
    (tmp / "call.pkl").write_bytes(pickle.dumps((fn.__module__, fn.__qualname__, args)))
    port = free_port()
    procs = []
    # the repo root first; a PYTHONPATH in ``env`` (e.g. the torch_npu double) after it, then the
    # caller's own (e.g. a Megatron-LM checkout for the megatron_lm tests)
    pythonpath = os.pathsep.join([str(ROOT)] + [p for p in ((env or {}).get("PYTHONPATH"),
                                                             os.environ.get("PYTHONPATH")) if p])
    for rank in range(world_size):
        rank_env = {**os.environ, **(env or {}), "RANK": str(rank), "LOCAL_RANK": str(rank),
                    "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                    "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath}
        log = open(tmp / f"rank{rank}.log", "w")
        procs.append((subprocess.Popen([sys.executable, "-m", "tests.distributed", str(tmp), str(rank)],
                                       env=rank_env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT), log))
    return procs


def _stop(procs: list) -> None:
    for p, log in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
        log.close()


def _main(tmp: str, rank: str) -> None:
    import importlib

    module, qualname, args = pickle.loads((Path(tmp) / "call.pkl").read_bytes())
    fn = importlib.import_module(module)
    for part in qualname.split("."):
        fn = getattr(fn, part)
    result = fn(*args)
    (Path(tmp) / f"rank{rank}.out").write_bytes(pickle.dumps(result))
    _leave_process_groups()


def _leave_process_groups() -> None:
    """Destroy the groups a rank function left alive. An interpreter that exits holding gloo groups can
    die in their threads' destructors ("terminate called without an active exception"), failing a rank
    whose function succeeded. Local to this rank: destroying a gloo group is no collective."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    _main(*sys.argv[1:3])

"""Launch real ranks for a test: fresh interpreters with torchrun's environment (gloo on the CPU backend).

``run_ranks(n, fn, *args)`` runs ``fn(*args)`` in n new Python processes (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT set as torchrun sets them) and returns each rank's return value. ``fn`` must be
a module-level function of an importable module. A failing rank's stderr is raised in the test; a rank
still running at the timeout is killed, so a broken collective fails the test instead of hanging it.

It, ``launch_ranks`` (every rank run to its own end, for tests of how ranks stop) and ``launch_script`` (a
script of the repository on fresh ranks, as a user starts it) are the suite's launchers of multi-rank tests:
every test that calls one is marked ``multiproc`` (tests/test_markers.py checks the sources).

Importing torch, the adapter and megatron costs a rank about 8 s of CPU, more than most rank functions
run. So ``run_ranks`` forks its ranks from an interpreter that has imported them once (a zygote), one per
environment the ranks run in apart from torchrun's variables: the adapter reads the backend, the kernel
provider and PYTHONPATH at import, so ranks of another environment get a zygote of their own. A forked
rank is a fresh process in every other respect: its own pid, environment, process groups and log, and an
exit status read by the zygote.

Only CPU ranks are forked. Choosing a cuda or npu backend asks the driver for its devices, and a process
that has asked cannot fork a child that uses the device ("Cannot re-initialize CUDA in forked
subprocess"). So the zygote says which backend its import chose; where that is an accelerator, or where
the zygote cannot import (a device backend this machine lacks), the ranks are fresh interpreters.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts.run_megatron_tests import free_port  # noqa: F401 - the launchers' port, also the tests'

ROOT = Path(__file__).resolve().parent.parent


class RankFailure(AssertionError):
    pass


def hang_seconds(line: str, pattern: str) -> int | None:
    """The seconds in the hang watch's line (adapter/liveness.py) where ``line`` is ``pattern`` around its
    ``timed out after N s`` (TIMED_OUT in ``pattern``), else None. The line gives the seconds the watcher
    measured: the timeout, or a little past it where a loaded machine runs its thread late, so callers bound
    them rather than expect one number."""
    found = re.fullmatch(pattern.replace("TIMED_OUT", r"timed out after (?P<seconds>\d+) s"), line)
    return None if found is None else int(found["seconds"])


def run_ranks(world_size: int, fn, *args, env: dict | None = None, timeout: float = 600.0) -> list:
    with tempfile.TemporaryDirectory(prefix="ranks-") as tmp:
        tmp = Path(tmp)
        procs = _start(tmp, world_size, fn, args, env, fork=True)
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


def launch_script(script: str, argv: list[str], world_size: int = 2, env: dict | None = None,
                  timeout: float = 300.0) -> list[tuple[int, str]]:
    """A script of the repository (e.g. scripts/pretrain_gpt.py) on ``world_size`` fresh interpreters with
    torchrun's environment, as a user launches it: per rank, (exit status, everything it printed)."""
    port, base = str(free_port()), _base_env(env)
    procs = [subprocess.Popen([sys.executable, script, *map(str, argv)], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT,
                              env={**base, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world_size),
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
             for r in range(world_size)]
    outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    return [(p.returncode, output) for p, output in zip(procs, outputs)]


def run_program(source: str, env: dict | None = None, timeout: float = 300.0) -> dict:
    """``python -c source`` in a fresh interpreter, in the repository on the cpu backend unless ``env`` says
    otherwise (``_base_env``): the JSON object the last line of its output holds (its exit status 0 asserted,
    with its stderr shown otherwise)."""
    done = subprocess.run([sys.executable, "-c", source], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=_base_env({"ADAPTER_BACKEND": "cpu", **(env or {})}))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _base_env(env: dict | None) -> dict:
    """What every rank of a call shares: the caller's environment, ``env``, one thread, and PYTHONPATH with
    the repo root first, a PYTHONPATH in ``env`` (e.g. the torch_npu double) after it, then the caller's
    own (e.g. a Megatron-LM checkout for the megatron_lm tests)."""
    pythonpath = os.pathsep.join([str(ROOT)] + [p for p in ((env or {}).get("PYTHONPATH"),
                                                             os.environ.get("PYTHONPATH")) if p])
    return {**os.environ, **(env or {}), "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath}


def _start(tmp: Path, world_size: int, fn, args: tuple, env: dict | None, fork: bool = False) -> list:
    (tmp / "call.pkl").write_bytes(pickle.dumps((fn.__module__, fn.__qualname__, args)))
    port, base = free_port(), _base_env(env)
    zygote = _Zygote.serving(base) if fork else None
    procs = []
    for rank in range(world_size):
        rank_env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                    "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        if zygote is not None:
            procs.append((zygote.fork(tmp, rank, rank_env), None))
            continue
        log = open(tmp / f"rank{rank}.log", "w")
        procs.append((subprocess.Popen([sys.executable, "-m", "tests.distributed", str(tmp), str(rank)],
                                       env=rank_env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT), log))
    return procs


def _stop(procs: list) -> None:
    for p, log in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
        if log is not None:
            log.close()


# Set per rank, or by pytest per test: they may differ from the zygote's without a fresh interpreter
_PER_RANK = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "PYTEST_CURRENT_TEST"}
# What the zygote imports: what nearly every rank function imports first
_PRELOAD = ("adapter", "megatron.core.parallel_state", "megatron.core.models.gpt", "megatron.core.optimizer",
            "megatron.core.distributed", "megatron.core.dist_checkpointing", "megatron.core.transformer.moe.moe_layer")


class _ForkedRank:
    """A rank forked by the zygote, with Popen's poll / kill / wait: its exit status is the file the
    zygote writes when it reaps it."""

    def __init__(self, pid: int, status: Path):
        self.pid, self._status, self.returncode = pid, status, None

    def poll(self) -> int | None:
        if self.returncode is None and self._status.exists():
            self.returncode = int(self._status.read_text())
        return self.returncode

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def wait(self, timeout: float = 60.0) -> int:
        deadline = time.monotonic() + timeout
        while self.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        if self.returncode is None:  # the zygote is gone: nobody reaps or reports
            self.returncode = -signal.SIGKILL
        return self.returncode


class _Zygote:
    """An interpreter that imported ``_PRELOAD`` under one environment and forks ranks on request. One per
    environment seen (a test's backend or kernel provider, an environment variable a test left set), the
    least recently used closed beyond ``_KEPT``."""

    _KEPT = 3
    _started: dict[tuple, _Zygote] = {}

    def __init__(self, env: dict):
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.distributed", "--zygote"], env=env, cwd=ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True)
        word, _, backend = self.proc.stdout.readline().strip().partition(" ")
        # an accelerator backend has asked the driver for its devices: its forks could not use the device
        self.ready = word == "ready" and backend == "cpu"
        if word == "ready" and not self.ready:
            self.close()

    @classmethod
    def serving(cls, env: dict) -> _Zygote | None:
        """The zygote for ranks with this environment (torchrun's variables aside), started on first use;
        None where its ranks would use an accelerator, or where it cannot import (e.g. a device backend this
        machine lacks): fresh interpreters then, which report an import error in the rank's log."""
        key = tuple(sorted((k, v) for k, v in env.items() if k not in _PER_RANK))
        zygote = cls._started.pop(key, None)
        if zygote is None or (zygote.ready and zygote.proc.poll() is not None):  # one that cannot fork stays
            zygote = cls(env)
        cls._started[key] = zygote  # the most recently used last
        while len(cls._started) > cls._KEPT:
            cls._started.pop(next(iter(cls._started))).close()
        return zygote if zygote.ready else None

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def fork(self, tmp: Path, rank: int, env: dict) -> _ForkedRank:
        self.proc.stdin.write(json.dumps({"tmp": str(tmp), "rank": rank, "env": env}) + "\n")
        self.proc.stdin.flush()
        return _ForkedRank(int(self.proc.stdout.readline()), tmp / f"rank{rank}.status")


def _zygote() -> None:
    """Import once, say which backend the import chose, then fork a rank per request on stdin (answering its
    pid), reap the ranks and write each one's exit status next to its log. Ends when stdin closes."""
    import importlib

    for name in _PRELOAD:
        importlib.import_module(name)
    backend = importlib.import_module("adapter").current_backend().name
    if backend == "cpu":
        _probe_cpu_vector_isa()
    print("ready", backend, flush=True)
    ranks: dict[int, Path] = {}
    while True:
        readable, _, _ = select.select([sys.stdin], [], [], 0.02)
        _reap(ranks)
        if not readable:
            continue
        line = sys.stdin.readline()
        if not line:
            break
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _run_forked(request)  # never returns
        ranks[pid] = Path(request["tmp"]) / f"rank{request['rank']}.status"
        print(pid, flush=True)
    for pid in ranks:
        os.kill(pid, signal.SIGKILL)


def _probe_cpu_vector_isa() -> None:
    """torch.compile on the CPU first asks which vector instructions its C++ builds can use, by building
    and loading a probe per candidate in subprocesses (about 1 s); the answer is cached per process. Asked
    once here, every forked rank that compiles (the torch provider's RMSNorm, megatron's fused functions)
    inherits it."""
    from torch._inductor import cpu_vec_isa

    cpu_vec_isa.valid_vec_isa_list()


def _reap(ranks: dict) -> None:
    while ranks:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        path = ranks.pop(pid, None)
        if path is not None:  # written whole, then renamed: the launcher never reads half a status
            path.with_suffix(".partial").write_text(str(os.waitstatus_to_exitcode(status)))
            path.with_suffix(".partial").replace(path)


def _run_forked(request: dict) -> None:
    """In the forked child: the rank's environment and log, then ``_main`` (which leaves its process
    groups), then ``os._exit``: the zygote's own interpreter state is not the rank's to tear down."""
    os.environ.clear()
    os.environ.update(request["env"])
    log = os.open(Path(request["tmp"]) / f"rank{request['rank']}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    code = 0
    try:
        _main(request["tmp"], str(request["rank"]))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    _exit_like_an_interpreter()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _exit_like_an_interpreter() -> None:
    """What a normal exit runs and ``os._exit`` skips: multiprocessing's finalizers. megatron's checkpoint
    writer starts a Manager (a spawned server process, ~200 MB) in each rank that saves; without its
    finalizer it outlives the rank, and a whole suite left a hundred of them (20 GB) behind."""
    import multiprocessing.util

    multiprocessing.util._exit_function()


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
    if sys.argv[1] == "--zygote":
        _zygote()
    else:
        _main(*sys.argv[1:3])

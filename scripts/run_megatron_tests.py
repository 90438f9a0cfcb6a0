"""Run Megatron-LM's own unit tests, unchanged, on CPU through the adapter, with real gloo ranks.

    python scripts/run_megatron_tests.py --megatron-lm /path/to/Megatron-LM [--nproc 8] [--backend cpu]
        [--timeout 300] [--json report.json] [PATHS...]

PATHS are relative to the checkout (default ``tests/unit_tests``). N ranks (torchrun's environment:
RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) each run pytest on the same paths from the
checkout; ``scripts/megatron_test_rank.py`` says what each rank does (the checkout's ``tests`` package,
the installed megatron.core, ``import adapter`` and ``adapter.route_cuda("tests")``), and
``scripts/megatron_skip_rules.py`` which tests need a CUDA-only library and are skipped for it.

Megatron's tests size their groups from WORLD_SIZE (its CI runs 8 ranks); a test needing more ranks
than it has skips itself or fails. A test passed only if it passed on every rank. When no rank reports
progress for ``--timeout`` seconds the ranks are killed, the tests then running count as failed (hung),
and a fresh set of ranks carries on with the tests not yet run; so does a rank that died. A set of
ranks destroys, after each test, the process groups nothing holds any more (megatron's
``destroy_model_parallel`` drops its groups without destroying them, and each gloo group keeps three
threads), and stops after the test that leaves ``--groups-per-set`` groups alive on a rank (in a
long-lived process they pile up until creating one more hangs), or that leaves the ranks with different
numbers of groups made (torch names groups by that number: the next test's would pair ranks wrongly); a
fresh set goes on. The last line is ``P passed, F failed, S skipped``; the exit status is 0 exactly when
F is 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RANK_SCRIPT = Path(__file__).resolve().parent / "megatron_test_rank.py"
DOUBLES = REPO / "tests" / "doubles"
# Megatron-LM's CI runs the unit tests with -m "not experimental and not flaky_in_dev" (dev environment)
DEFAULT_MARKERS = "not experimental and not flaky and not flaky_in_dev"
ORDER = {"passed": 0, "skipped": 1, "failed": 2}
# before its first event a rank is importing torch, the adapter and pytest: on a loaded 2-core machine
# with 8 ranks that alone can take minutes, and is no hang
STARTUP_SECONDS = 600


@dataclasses.dataclass
class Outcome:
    """One test's outcome folded over its phases and ranks."""

    outcome: str
    reason: str = ""
    detail: str = ""
    ranks: dict = dataclasses.field(default_factory=dict)  # rank -> that rank's outcome


# ------------------------------------------------------------------------------------------ launching
_LISTEN_PORTS_FROM = 10000


@functools.cache
def _ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (Linux's default 32768 where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_port_cursor = random.Random(os.getpid()).randrange(1 << 16)


def free_port() -> int:
    """A port for the rendezvous store, which rank 0 binds seconds later (after its imports). It lies below
    the kernel's ephemeral range, which gloo's connections and every other outgoing socket draw from, so
    in between nothing but another listener can take it: a port picked from the ephemeral range was taken
    by a gloo connection of a test running beside this one (pytest-xdist) before rank 0 bound it. Each
    process walks the range from its own start (its pid), so two runs side by side pick different ports."""
    global _port_cursor
    low = _ephemeral_low()
    for _ in range(max(low - _LISTEN_PORTS_FROM, 0)):
        port = _LISTEN_PORTS_FROM + _port_cursor % (low - _LISTEN_PORTS_FROM)
        _port_cursor += 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # no room below the ephemeral range: any port the kernel gives
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rendezvous_store():
    """The store a set of ranks meets in, hosted here as torchrun's agent hosts it: listening from the
    moment it is made, on a port the kernel gives, so no other socket can take the port between its choice
    and the ranks' rendezvous (a port merely checked free was taken in between, once, on a loaded machine);
    the ranks connect to it as clients (``TORCHELASTIC_USE_AGENT_STORE``, rank_env). One per set: a fresh
    set of ranks must not read the keys a killed one left."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def rank_env(rank: int, nproc: int, port: int, backend: str, deselect: Path, max_groups: int = 0) -> dict:
    """torchrun's environment for one rank, on the chosen backend, meeting in the harness's store
    (rendezvous_store); the torch_npu double for npu."""
    pythonpath = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p] + [str(REPO)]
    if backend == "npu":
        pythonpath.insert(0, str(DOUBLES))
    # gloo connects a group's ranks when the group is first used, as NCCL creates its communicators: megatron
    # builds some thirty groups per test, most never used, and connecting each at once dominated the runtime
    lazy = {"TORCH_GLOO_LAZY_INIT": os.environ.get("TORCH_GLOO_LAZY_INIT", "1")}
    return {**os.environ, **lazy, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "TORCHELASTIC_USE_AGENT_STORE": str(True), "OMP_NUM_THREADS": "1", "ADAPTER_BACKEND": backend,
            "PYTHONPATH": os.pathsep.join(pythonpath),
            "MEGATRON_TESTS_DESELECT": str(deselect), "MEGATRON_TESTS_MAX_GROUPS": str(max_groups),
            "PYTHONUNBUFFERED": "1"}


def pytest_args(args, attempt_dir: Path, rank: int) -> list[str]:
    """pytest's arguments in every rank: Megatron-LM's addopts (``-x`` stops a rank at its first failure,
    leaving the others in a collective) replaced; a base temp dir per rank whose parent the ranks share,
    as Megatron's ``tmp_path_dist_ckpt`` fixture expects."""
    return ["-o", "addopts=", "-p", "no:cacheprovider", "-q", "-rN", "--tb=short",
            "--continue-on-collection-errors",
            "-m", args.markers, f"--basetemp={attempt_dir / 'basetemp' / f'rank{rank}'}",
            *(f"--ignore={path}" for path in args.ignore), *args.paths]


def launch(args, attempt_dir: Path, deselect: set[str], port: int) -> list[subprocess.Popen]:
    """Start the ranks of one attempt, meeting in the store at ``port``; each writes its events to
    ``attempt_dir/rank<R>.jsonl``."""
    (attempt_dir / "basetemp").mkdir(parents=True)  # pytest makes each rank's --basetemp, not its parent
    deselect_file = attempt_dir / "deselect.txt"
    deselect_file.write_text("\n".join(sorted(deselect)))
    procs = []
    for rank in range(args.nproc):
        log = open(attempt_dir / f"rank{rank}.log", "w")
        command = [sys.executable, str(RANK_SCRIPT), str(args.megatron_lm), str(attempt_dir / f"rank{rank}.jsonl"),
                   *pytest_args(args, attempt_dir, rank)]
        procs.append(subprocess.Popen(command, cwd=args.megatron_lm, stdout=log, stderr=subprocess.STDOUT,
                                      env=rank_env(rank, args.nproc, port, args.backend, deselect_file,
                                                   args.groups_per_set)))
        log.close()
    return procs


def _progress(attempt_dir: Path) -> int:
    return sum(p.stat().st_size for p in attempt_dir.glob("rank*.jsonl"))


def kill(procs: list[subprocess.Popen]) -> None:
    """Kill every rank still running and reap them all: a rank left behind would hold its port and CPU."""
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()


def dump_stacks(procs: list[subprocess.Popen]) -> None:
    """Each live rank writes its Python stack to its log (faulthandler on SIGUSR1), to say where it hung."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGUSR1)
    time.sleep(2)


def hung_at(dump: Path) -> str:
    """The innermost frame of the last stack a rank dumped, or '' when there is none."""
    lines = dump.read_text(errors="replace").splitlines() if dump.is_file() else []
    starts = [i for i, line in enumerate(lines) if line.endswith("(most recent call first):")]
    frames = [line.strip() for line in lines[starts[-1] + 1:starts[-1] + 2]] if starts else []
    return frames[0] if frames else ""


def watch(procs: list[subprocess.Popen], attempt_dir: Path, timeout: float) -> bool:
    """Wait for the ranks to end; kill them all when none has reported progress for ``timeout`` seconds
    (or when the harness itself is stopped: no rank outlives it). Returns whether they were killed."""
    last, last_change = 0, time.monotonic()
    try:
        while any(p.poll() is None for p in procs):
            size = _progress(attempt_dir)
            if size != last:
                last, last_change = size, time.monotonic()
            limit = timeout if last else max(timeout, STARTUP_SECONDS)
            if time.monotonic() - last_change > limit:
                dump_stacks(procs)
                kill(procs)
                return True
            time.sleep(0.5)
    finally:
        kill(procs)
    return False


# ------------------------------------------------------------------------------------------ folding
def read_events(path: Path) -> list[dict]:
    """One rank's events; a killed rank may have left half a line, which is dropped."""
    if not path.is_file():
        return []
    events = []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:  # the line a killed rank was writing
            pass
    return events


def rank_results(events: list[dict]) -> tuple[dict, set, str | None]:
    """One rank's ``{nodeid: Outcome}`` for the tests it finished (every phase, or a collection report),
    the tests it started but did not finish, and the last one it started."""
    results, finished, started, last = {}, set(), set(), None
    for event in events:
        if event["event"] == "start":
            started.add(event["nodeid"])
            last = event["nodeid"]
        elif event["event"] == "report":
            current = results.get(event["nodeid"])
            if current is None or ORDER[event["outcome"]] > ORDER[current.outcome]:
                results[event["nodeid"]] = Outcome(event["outcome"], event["reason"], event.get("detail", ""))
            if event["when"] in ("teardown", "collect"):
                finished.add(event["nodeid"])
    done = {nodeid: outcome for nodeid, outcome in results.items() if nodeid in finished}
    return done, started - finished, last


def fold_ranks(per_rank: list[dict]) -> dict[str, Outcome]:
    """The tests every rank finished: failed when any rank failed, passed when any passed and none failed,
    else skipped; the reason is that of the first rank with the worst outcome."""
    common = set.intersection(*(set(r) for r in per_rank)) if per_rank else set()
    folded = {}
    for nodeid in common:
        outcomes = [r[nodeid] for r in per_rank]
        worst = max(outcomes, key=lambda o: ORDER[o.outcome])
        reason = worst.reason if worst.outcome != "failed" else (
            f"rank {outcomes.index(worst)}: {worst.reason}")
        folded[nodeid] = Outcome(worst.outcome, reason, worst.detail,
                                 {rank: o.outcome for rank, o in enumerate(outcomes)})
    return folded


def unfinished(per_rank_running: list[set], killed: bool, statuses: list, where: list[str]) -> dict[str, Outcome]:
    """The tests a rank was inside when it was killed or died: failed, with the reason (for a hang, the
    frame each rank's stack dump ends in)."""
    out = {}
    for rank, running in enumerate(per_rank_running):
        for nodeid in running:
            if killed:
                why = f"killed: no rank reported progress for the timeout (hung on rank {rank}" + (
                    f" at {where[rank]})" if where[rank] else ")")
            else:
                why = f"rank {rank} died (exit status {statuses[rank]}) inside this test"
            out.setdefault(nodeid, Outcome("failed", why, ranks={rank: "killed" if killed else "died"}))
    return out


# ------------------------------------------------------------------------------------------ attempts
def run_attempt(args, attempt_dir: Path, settled: dict[str, Outcome]) -> tuple[dict, set | None, bool]:
    """One set of ranks over the tests not yet settled: (newly settled outcomes, tests collected, None
    when no rank finished collecting; whether the set was killed or a rank died)."""
    store = rendezvous_store()
    procs = launch(args, attempt_dir, set(settled), store.port)
    killed = watch(procs, attempt_dir, args.timeout)
    del store  # the set's ranks are gone (watch reaps them all): nothing meets in it any more
    statuses = [p.returncode for p in procs]
    events = [read_events(attempt_dir / f"rank{r}.jsonl") for r in range(args.nproc)]
    per_rank = [rank_results(e) for e in events]
    new = fold_ranks([done for done, _, _ in per_rank])
    broken = killed or any(s not in (0, 1) for s in statuses)
    if broken:
        where = [hung_at(attempt_dir / f"rank{r}.jsonl.stack") for r in range(args.nproc)]
        running = [running for _, running, _ in per_rank]
        new.update({k: v for k, v in unfinished(running, killed, statuses, where).items() if k not in new})
    lists = [e["nodeids"] for rank in events for e in rank if e["event"] == "collected"]
    return new, set().union(*lists) if lists else None, broken


def run_all(args, work: Path) -> dict[str, Outcome]:
    """Sets of ranks until every collected test is settled. A set that stopped at ``--groups-per-set``
    process groups alive is followed by a fresh one; at most ``--max-attempts`` sets may end killed or
    with a rank dead; a set that settles nothing ends the run, its remaining tests failed with the first
    rank log's tail."""
    settled: dict[str, Outcome] = {}
    broken_sets, attempt = 0, 0
    while True:
        attempt_dir = work / f"attempt{attempt}"
        new, collected, broken = run_attempt(args, attempt_dir, settled)
        progress = set(new) - set(settled)  # a module that failed to import is reported by every attempt
        settled.update(new)
        remaining = (set(args.paths) if collected is None else collected) - set(settled)
        if not remaining:
            return settled
        broken_sets, attempt = broken_sets + broken, attempt + 1
        if not progress or broken_sets >= args.max_attempts:
            break
    why = f"never finished on every rank; rank 0's log ends: {_log_tail(attempt_dir / 'rank0.log')}"
    settled.update({nodeid: Outcome("failed", why) for nodeid in remaining})
    return settled


def _log_tail(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()] if log.is_file() else []
    return lines[-1][:300] if lines else "(empty log)"


# ------------------------------------------------------------------------------------------ reporting
def directory_of(nodeid: str) -> str:
    """The directory of a test's file, relative to the checkout (a top-level file: its own directory)."""
    return str(Path(nodeid.split("::")[0]).parent)


def counts(results: dict[str, Outcome]) -> Counter:
    return Counter(o.outcome for o in results.values())


def report(results: dict[str, Outcome], out=sys.stdout) -> int:
    """Failures and skips with their reasons, then ``P passed, F failed, S skipped``; the failure count."""
    for nodeid in sorted(results):
        outcome = results[nodeid]
        if outcome.outcome != "passed":
            print(f"{outcome.outcome.upper()} {nodeid} - {outcome.reason}", file=out)
    skipped_by_reason = Counter(o.reason for o in results.values() if o.outcome == "skipped")
    for reason, n in skipped_by_reason.most_common():
        print(f"skip reason ({n}): {reason}", file=out)
    total = counts(results)
    print(f"{total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped", file=out)
    return total["failed"]


def json_report(results: dict[str, Outcome], args, seconds: float) -> dict:
    """Per-test outcome, reason, traceback and per-rank outcomes, with per-directory counts (for
    docs/CONFORMANCE.md)."""
    by_dir: dict[str, Counter] = {}
    for nodeid, outcome in results.items():
        by_dir.setdefault(directory_of(nodeid), Counter())[outcome.outcome] += 1
    return {"command": sys.argv, "backend": args.backend, "nproc": args.nproc, "seconds": round(seconds, 1),
            "totals": dict(counts(results)),
            "directories": {d: {k: c[k] for k in ("passed", "failed", "skipped")} for d, c in sorted(by_dir.items())},
            "tests": {nodeid: dataclasses.asdict(o) for nodeid, o in sorted(results.items())}}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megatron-lm", required=True, type=Path, help="a Megatron-LM checkout (core_v0.16.1)")
    parser.add_argument("--nproc", type=int, default=8, help="ranks (WORLD_SIZE); Megatron's CI uses 8")
    parser.add_argument("--backend", choices=("cpu", "npu"), default=os.environ.get("ADAPTER_BACKEND") or "cpu",
                        help="npu: the torch_npu double and a stand-in torch.npu, as a routing check")
    parser.add_argument("--timeout", type=float, default=300, help="seconds without progress before a kill")
    parser.add_argument("--markers", default=DEFAULT_MARKERS, help="pytest -m expression")
    parser.add_argument("--max-attempts", type=int, default=20, help="sets of ranks that may end killed or dead")
    parser.add_argument("--groups-per-set", type=int, default=400,
                        help="process groups alive on a rank before a fresh set goes on (0: no limit, and "
                             "dropped groups are not destroyed)")
    parser.add_argument("--ignore", action="append", default=[], metavar="PATH",
                        help="a path under PATHS not to run (pytest's --ignore), relative to the checkout")
    parser.add_argument("--json", type=Path, help="write the per-test report here")
    parser.add_argument("--keep", type=Path, help="keep the rank logs and events in this directory")
    parser.add_argument("paths", nargs="*", default=["tests/unit_tests"])
    args = parser.parse_args(argv)
    args.megatron_lm = args.megatron_lm.resolve()
    if not (args.megatron_lm / "tests" / "unit_tests").is_dir():
        parser.error(f"{args.megatron_lm} has no tests/unit_tests: give a Megatron-LM checkout")
    return args


def main(argv: list[str] | None = None) -> int:
    """Exit status 0 exactly when no test failed."""
    args = parse_args(argv)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="megatron-tests-") as tmp:
        if args.keep:
            args.keep.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix="run-", dir=args.keep)) if args.keep else Path(tmp)
        results = run_all(args, work)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(json_report(results, args, time.monotonic() - start), indent=1))
    return 1 if report(results) else 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # runs watch's finally
    sys.exit(main())

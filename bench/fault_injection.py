"""Faults injected into real training runs on CPU ranks, from outside, as a cluster inflicts them (issue 36).

Every run is scripts/pretrain_gpt.py under ``scripts/launch.py --max-restarts 3`` (torchrun, with a preempted
job that saved exiting 0) on two gloo ranks: the tiny Qwen2.5 at TP 2, 24 iterations of a real corpus
(megatron's indexed dataset of random token ids, written here), a checkpoint every 4 (``--save`` = ``--load``,
so a restart resumes), ``--exit-signal-handler``. The faults:

- ``none``: the clean run, whose losses every other run must give;
- ``kill-twice``: a rank SIGKILLed at a random moment, twice in one run (mid-step or mid-save, as it falls);
- ``stall``: a rank SIGSTOPped at a random moment (alive, silent): the job must end the hung generation within
  ``--distributed-timeout-minutes`` and restart;
- ``sigterm``: SIGTERM to the job's process group (what a scheduler sends); then the same command again;
- ``nan``: ``--lr 1e12``, the loss non-finite from the second iteration: refused in one line, nothing saved
  after the bad step;
- ``corrupt-data``: the corpus's .bin cut short: refused in one line before the first step.

The table: faults injected, runs (launches) completed (the last iteration reached, every launch exited 0),
checkpoints lost (one saved before a fault and gone after it, or a saved one that does not load), losses equal
to the clean run's exactly (every iteration's last logged loss), seconds to recover (from the fault to the
resumed run's first iteration), and the one error line users see (the survivors' where a rank is lost or
stalls, the refusal where the fault is refused). The moments are drawn from ``--seed``.

    python bench/fault_injection.py [--faults none kill-twice ...] [--seed 0] [--timeout-minutes 1] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ITERATIONS, SAVE_EVERY = 24, 4
LINE = re.compile(r"iteration +(\d+)/ +\d+ \|.*\| lm loss: ([0-9.E+-]+|nan|inf)", re.IGNORECASE)
FAULTS = ("none", "kill-twice", "stall", "sigterm", "nan", "corrupt-data")


def write_corpus(prefix: Path, vocab: int = 500, documents: int = 400, seed: int = 0) -> None:
    """A corpus of random token ids in megatron's indexed format (what scripts/preprocess_data.py writes)."""
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    generator = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=np.uint16)
    for _ in range(documents):
        builder.add_document(torch.from_numpy(generator.integers(0, vocab, 200, dtype=np.int64)), [200])
    builder.finalize(str(prefix) + ".idx")


def command(corpus: Path, checkpoints: Path, timeout_minutes: int, *extra: str) -> list[str]:
    return [sys.executable, str(ROOT / "scripts" / "launch.py"), "--standalone", "--nproc-per-node", "2",
            "--max-restarts", "3", str(ROOT / "scripts" / "pretrain_gpt.py"), "--model", "qwen2.5-tiny",
            "--tensor-model-parallel-size", "2", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--seq-length", "64", "--train-iters", str(ITERATIONS), "--lr", "3e-3", "--min-lr", "3e-4",
            "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--tokenizer-type", "NullTokenizer",
            "--data-path", str(corpus), "--split", "100,0,0", "--log-interval", "1", "--eval-iters", "0",
            "--eval-interval", str(ITERATIONS),
            "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "7", "--save", str(checkpoints),
            "--load", str(checkpoints), "--save-interval", str(SAVE_EVERY), "--exit-signal-handler",
            "--distributed-timeout-minutes", str(timeout_minutes), *extra]


class Launch:
    """One torchrun launch in a session of its own, its output read line by line as it comes."""

    def __init__(self, argv: list[str], log: Path):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               "ADAPTER_BACKEND": "cpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.log = log.open("w")
        self.process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, start_new_session=True)
        self.lines: list[tuple[float, str]] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append((time.monotonic(), line))
            self.log.write(line)

    def iterations(self) -> list[tuple[float, int, float]]:
        """(time, iteration, loss) of every iteration line so far."""
        return [(t, int(m[1]), float(m[2])) for t, line in list(self.lines) if (m := LINE.search(line))]

    def wait_for_iteration(self, at_least: int, since: float = 0.0, limit: float = 600) -> bool:
        """Wait until an iteration >= ``at_least`` is logged after ``since`` (a resumed generation's, after a
        fault)."""
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline and self.process.poll() is None:
            if any(i >= at_least for t, i, _ in self.iterations() if t > since):
                return True
            time.sleep(0.05)
        return False

    def workers(self) -> list[int]:
        """The training processes: the torchrun agent's children."""
        children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children")
        return [int(pid) for pid in children.read_text().split()] if children.exists() else []

    def finish(self, limit: float = 900) -> int:
        try:
            status = self.process.wait(limit)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            status = self.process.wait()
        self.reader.join(5)
        self.log.close()
        return status


def _losses(launches: list[Launch]) -> dict[int, float]:
    """Each iteration's last logged loss over the launches, in order (a restart logs resumed iterations again)."""
    out = {}
    for launch in launches:
        out.update({i: loss for _, i, loss in launch.iterations()})
    return out


def _recovery(launches: list[Launch], fault_times: list[float]) -> float | None:
    """The longest time from a fault to the resumed run's first iteration: the first one logged after the
    next ``loaded <checkpoint>`` line (a restarted generation's, or the next launch's)."""
    lines = [(t, line) for launch in launches for t, line in launch.lines]
    gaps = []
    for at in fault_times:
        loaded = next((t for t, line in lines if t > at and line.startswith("loaded ")), None)
        resumed = next((t for t, line in lines if loaded is not None and t > loaded and LINE.search(line)), None)
        gaps.append(None if resumed is None else resumed - at)
    return None if not gaps or None in gaps else max(gaps)


def _checkpoints(directory: Path) -> set[int]:
    return {int(p.name[5:]) for p in directory.glob("iter_*") if p.is_dir() and p.name[5:].isdigit()}


def _error_lines(launches: list[Launch]) -> list[str]:
    return sorted({line.strip() for launch in launches for _, line in launch.lines if line.startswith("error:")})


class Case:
    """One fault's run: its launches, the moments of its faults, what was on disk before each."""

    def __init__(self, name: str, work: Path, corpus: Path, args, rng: random.Random):
        self.name, self.work, self.corpus, self.args, self.rng = name, work / name, corpus, args, rng
        self.work.mkdir(parents=True)
        self.launches: list[Launch] = []
        self.fault_times: list[float] = []
        self.saved_before: set[int] = set()

    def launch(self, *extra: str) -> Launch:
        argv = command(self.corpus, self.work / "checkpoints", self.args.timeout_minutes, *extra)
        self.launches.append(Launch(argv, self.work / f"launch{len(self.launches)}.log"))
        return self.launches[-1]

    def strike(self, launch: Launch, after_iteration: int, act) -> None:
        """At a random moment after ``after_iteration`` is logged (since the last fault): ``act(launch)``,
        noted, with what was saved before it, where it struck (a generation between restarts has no workers)."""
        since = self.fault_times[-1] if self.fault_times else 0.0
        if not launch.wait_for_iteration(after_iteration, since):
            return
        time.sleep(self.rng.uniform(0, 0.3))  # an iteration of this run takes 0.1-0.3 s
        saved = _checkpoints(self.work / "checkpoints")
        deadline = time.monotonic() + 30
        while not act(launch) and time.monotonic() < deadline:
            time.sleep(0.1)
        if time.monotonic() < deadline:
            self.saved_before |= saved
            self.fault_times.append(time.monotonic())

    def signal_a_worker(self, sig: int):
        def act(launch: Launch) -> bool:
            workers = launch.workers()
            if workers:
                os.kill(self.rng.choice(workers), sig)
            return bool(workers)
        return act


def run_case(name: str, work: Path, corpus: Path, args, rng: random.Random) -> tuple[Case, list[int]]:
    case = Case(name, work, corpus, args, rng)
    if name in ("none", "kill-twice", "stall"):
        launch = case.launch()
        if name == "kill-twice":
            first = rng.randint(3, 9)
            case.strike(launch, first, case.signal_a_worker(signal.SIGKILL))
            case.strike(launch, rng.randint(first + 1, 18), case.signal_a_worker(signal.SIGKILL))
        elif name == "stall":
            case.strike(launch, rng.randint(3, 12), case.signal_a_worker(signal.SIGSTOP))
        return case, [launch.finish()]
    if name == "sigterm":
        launch = case.launch()
        case.strike(launch, rng.randint(3, 14), lambda launch: os.killpg(launch.process.pid, signal.SIGTERM) or True)
        statuses = [launch.finish()]
        return case, statuses + [case.launch().finish()]
    if name == "nan":
        return case, [case.launch("--lr", "1e12").finish()]
    bin_path = Path(str(corpus) + ".bin")  # corrupt-data: a copy of the corpus, cut short
    copy = case.work / "corpus"
    for suffix in (".bin", ".idx"):
        Path(str(copy) + suffix).write_bytes(Path(str(corpus) + suffix).read_bytes())
    Path(str(copy) + ".bin").write_bytes(bin_path.read_bytes()[:-2])
    case.corpus = copy
    return case, [case.launch().finish()]


def row(case: Case, statuses: list[int], clean: dict[int, float] | None) -> dict:
    losses = _losses(case.launches)
    completed = max(losses, default=0) == ITERATIONS and not any(statuses)
    saved = _checkpoints(case.work / "checkpoints")
    errors = _error_lines(case.launches)
    equal = None if not completed or clean is None else losses == clean
    return {"fault": case.name, "injected": len(case.fault_times) or (1 if case.name in ("nan", "corrupt-data")
                                                                          else 0),
            "launches": len(case.launches), "exit statuses": statuses, "completed": completed,
            "checkpoints lost": len(case.saved_before - saved), "losses equal": equal,
            "recovery s": _recovery(case.launches, case.fault_times), "error line": errors[0] if errors else None,
            "saved": sorted(saved)}


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.1f}"
    return str(value)


def table(rows: list[dict]) -> str:
    header = ["fault", "injected", "launches", "completed", "checkpoints lost", "losses equal", "recovery s",
              "error line"]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(_cell(r[h]) for h in header) + " |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", nargs="+", choices=FAULTS, default=list(FAULTS))
    parser.add_argument("--seed", type=int, default=0, help="draws the faults' moments and ranks")
    parser.add_argument("--timeout-minutes", type=int, default=1,
                        help="--distributed-timeout-minutes (megatron.training takes whole minutes)")
    parser.add_argument("--work", help="keep the runs' logs and checkpoints here (default: a temporary folder)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    work = Path(args.work or tempfile.mkdtemp(prefix="faults-"))
    work.mkdir(parents=True, exist_ok=True)
    corpus = work / "corpus"
    write_corpus(corpus)
    rng, rows, clean = random.Random(args.seed), [], None
    for name in dict.fromkeys(["none", *args.faults]):
        start = time.monotonic()
        case, statuses = run_case(name, work, corpus, args, rng)
        rows.append({**row(case, statuses, clean), "seconds": time.monotonic() - start})
        clean = clean or (_losses(case.launches) if rows[-1]["completed"] else None)
        print(f"{name}: {json.dumps(rows[-1])}", flush=True)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    print(f"logs and checkpoints: {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

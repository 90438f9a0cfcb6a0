"""Import overhead of the adapter: ``import adapter`` plus every patch, against megatron-core alone.

Each measurement is a fresh interpreter (``sys.executable -c ...``, ADAPTER_BACKEND=cpu) that times its
own imports, wall clock (``time.perf_counter``) and CPU time of the process (``time.process_time``), and
prints them, so interpreter start-up is left out. Three
kinds of run, interleaved in every round (the order alternates round by round, so drift on the machine
hits every kind alike):

- ``megatron``: ``import megatron.core`` and every megatron module the patch table targets;
- ``adapter``:  ``import adapter`` first, then the very same imports, then (untimed) a check that no
  patch is left 'pending' or in 'error' for the cpu backend;
- ``core``:     ``import megatron.core`` alone, for a second ratio.

The module list comes from ``adapter.registry.patches()`` in this process, once, and is handed to every
child, so the ``megatron`` and ``adapter`` runs import the same modules. The main ratio
``adapter / megatron`` is the cost of the adapter itself; ``adapter / core`` also counts the megatron
modules that the patch table pulls in beyond ``megatron.core``.

The final line uses the wall clock unless ``--clock cpu`` is given. On a machine busy with other work
(the load average is printed) wall-clock samples spread widely; CPU time is the steadier figure there.

``--baseline REV`` adds a fourth kind, ``adapter@REV``: the same imports with the adapter of an earlier
revision (a git worktree of REV), so a change to the adapter is measured against what it replaced.

Usage: python bench/import_overhead.py [--repeats 5] [--warmup 1] [--clock wall|cpu] [--baseline REV]
Exits 0 whatever the overhead is (a benchmark, not a test); exits 1 only when a child run fails.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import baseline  # noqa: E402 - bench/ is not a package
GOAL_PERCENT = 10.0

# argv[1:] of each child: the megatron modules to import after the first statement.
_CHILD = r"""
import sys, time, importlib
t0, c0 = time.perf_counter(), time.process_time()
{first}
for _name in sys.argv[1:]:
    importlib.import_module(_name)
elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
{check}
print("RESULT", elapsed, cpu, len(sys.modules))
"""

_ADAPTER_CHECK = r"""
import adapter as _adapter
_bad = []
for _p in _adapter.registry.patches():
    if _p.module not in sys.argv[1:]:
        continue  # megatron.training targets: no Megatron-LM checkout here
    _s = _adapter.registry.status(_p.target)
    if _s == "pending" or _s.startswith("error"):
        _bad.append(f"{_p.target}: {_s}")
assert _adapter.current_backend().name == "cpu", _adapter.current_backend()
assert not _bad, "patches not applied on cpu:\n" + "\n".join(_bad)
"""

KINDS = {
    "megatron": _CHILD.format(first="import megatron.core", check=""),
    "adapter": _CHILD.format(first="import adapter\nimport megatron.core", check=_ADAPTER_CHECK),
    "core": _CHILD.format(first="import megatron.core", check=""),
}


def target_modules() -> list[str]:
    """The megatron modules named by the patch table (all backends), from the adapter's registry."""
    os.environ.setdefault("ADAPTER_BACKEND", "cpu")  # choosing a backend is part of import adapter
    sys.path.insert(0, str(ROOT))
    import adapter

    return sorted(m for m in {p.module for p in adapter.registry.patches()} if _importable(m))


def _importable(module: str) -> bool:
    """megatron.training / megatron.legacy targets exist only with a Megatron-LM checkout on PYTHONPATH."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def run_child(kind: str, modules: list[str], roots: dict | None = None) -> tuple[float, float, int]:
    """(wall seconds importing, CPU seconds importing, len(sys.modules)) of one fresh child; ``adapter@REV``
    imports the adapter of that revision's tree (``roots``), without this tree's patch check."""
    kind, _, rev = kind.partition("@")
    root = (roots or {}).get(rev, ROOT)
    env = {**os.environ, "ADAPTER_BACKEND": "cpu", "PYTHONPATH": baseline.pythonpath(root, os.environ)}
    code = _CHILD.format(first="import adapter\nimport megatron.core", check="") if rev else KINDS[kind]
    args = [sys.executable, "-c", code] + (modules if kind != "core" else [])
    proc = subprocess.run(args, cwd=root, env=env, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(f"{kind} run failed (exit {proc.returncode}):\n{proc.stdout}{proc.stderr[-4000:]}")
        raise SystemExit(1)
    _, seconds, cpu, count = lines[-1].split()
    return float(seconds), float(cpu), int(count)


def _load() -> str:
    try:
        one, five, _ = os.getloadavg()
    except OSError:
        return "load average unknown"
    return f"load average {one:.1f} (1 min) / {five:.1f} (5 min) on {os.cpu_count()} CPUs"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="measured rounds (default 5)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="unmeasured rounds first, to fill the bytecode and file caches (default 1)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="which clock the final line reports (default wall)")
    parser.add_argument("--json", action="store_true", help="also print the raw samples as JSON")
    parser.add_argument("--baseline", metavar="REV", help="also import the adapter of this git revision")
    opts = parser.parse_args()
    if opts.repeats < 1 or opts.warmup < 0:
        parser.error("--repeats must be >= 1 and --warmup >= 0")

    modules = target_modules()
    order = ["megatron", "adapter", "core"] + ([f"adapter@{opts.baseline}"] if opts.baseline else [])
    wall = {kind: [] for kind in order}
    cpu = {kind: [] for kind in order}
    counts = {}
    load_before = _load()
    with contextlib.ExitStack() as stack:
        roots = {opts.baseline: stack.enter_context(baseline.worktree(opts.baseline))} if opts.baseline else {}
        for rnd in range(opts.warmup + opts.repeats):
            for kind in (order if rnd % 2 == 0 else order[::-1]):
                seconds, cpu_seconds, count = run_child(kind, modules, roots)
                counts[kind] = count
                if rnd >= opts.warmup:
                    wall[kind].append(seconds)
                    cpu[kind].append(cpu_seconds)

    med = {kind: statistics.median(v) for kind, v in wall.items()}
    med_cpu = {kind: statistics.median(v) for kind, v in cpu.items()}
    label = {"megatron": f"megatron.core + {len(modules)} targeted modules",
             "adapter": f"adapter + megatron.core + same {len(modules)}",
             "core": "megatron.core only", f"adapter@{opts.baseline}": f"adapter of {opts.baseline} + same"}

    print(f"import overhead: {opts.repeats} fresh processes per row (after {opts.warmup} warm-up), "
          f"ADAPTER_BACKEND=cpu, python {sys.version.split()[0]}")
    print(f"patch table targets {len(modules)} megatron modules; {load_before} before, {_load()} after")
    print()
    print(f"{'run':<9} {'imports':<44} {'wall med':>8} {'min':>6} {'max':>6} "
          f"{'cpu med':>8} {'modules':>8}")
    for kind in order:
        print(f"{kind:<9} {label[kind]:<44} {med[kind]:>8.3f} {min(wall[kind]):>6.3f} "
              f"{max(wall[kind]):>6.3f} {med_cpu[kind]:>8.3f} {counts[kind]:>8}")
    print("(seconds; wall = time.perf_counter, cpu = time.process_time of the child)")
    print()
    for clock, m in (("wall", med), ("cpu", med_cpu)):
        print(f"{clock:<4} adapter / megatron (same modules): {m['adapter'] / m['megatron']:.3f} "
              f"({m['adapter'] - m['megatron']:+.3f} s);  adapter / megatron.core alone: "
              f"{m['adapter'] / m['core']:.3f} ({m['adapter'] - m['core']:+.3f} s)")
    if opts.baseline:
        base = f"adapter@{opts.baseline}"
        print(f"this tree / {opts.baseline}: wall {med['adapter'] / med[base]:.3f}, cpu "
              f"{med_cpu['adapter'] / med_cpu[base]:.3f} (below 1: imports faster now)")
    if opts.json:
        print(json.dumps({"modules": modules, "wall": wall, "cpu": cpu}))
    m = med if opts.clock == "wall" else med_cpu
    ratio = m["adapter"] / m["megatron"]
    print(f"import overhead: adapter adds {(ratio - 1) * 100:.1f}% (ratio {ratio:.3f}, {opts.clock} clock), "
          f"goal < {GOAL_PERCENT:.0f}%")


if __name__ == "__main__":
    main()

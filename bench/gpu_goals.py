"""The GPU issue's goals against what one `.ci/gpu_check.sh` run measured: met, not met (with the number),
failed (with the error's last line), or not run.

It reads the run's folder: ``cuda_tests-<setting>.xml`` (pytest's junit report of the ``cuda`` tests, one per
setting: ``liger``, ``no-liger``, ``fused-eager``, ``fused-compile``, and ``kernels``, the cuda provider's
kernel tests), ``dense*.json`` (bench/gpu_train.py --json; ``dense-hybrid.json`` the Qwen3.5 pair),
``moe-<shape>.json`` (bench/moe.py flow --json) and ``startup.json`` (bench/startup.py --json). A goal whose
file or row is missing was not run (the check's deadline came first, or the step was not asked for); one
measured at another shape (a dry run) neither.

Usage: python bench/gpu_goals.py LOG_DIR        # prints the table and writes LOG_DIR/goals.md
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

DENSE_MODELS = ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen3-1.7b")
LARGE_DENSE = ("qwen2.5-1.5b", "qwen3-1.7b")
HYBRID_MODEL = "qwen3.5-bench"
# the run with Liger-Kernel installed is ADAPTER_CUDA_FUSED's automatic choice, liger; without it, compile
TEST_SETTINGS = {"liger": "Liger-Kernel installed", "no-liger": "Liger-Kernel not installed",
                 **{f"fused-{c}": f"ADAPTER_CUDA_FUSED={c}" for c in ("eager", "compile")},
                 "kernels": "each choice's kernels against float64 (test_cuda_provider_kernels.py)"}
FUSED_CHOICES = ("eager", "compile", "liger")
SPEED_TIE = 0.02  # the automatic choice may trail the fastest by this much (run-to-run noise)


def _load(path: Path):
    return json.loads(path.read_text()) if path.exists() else None


def _last_line(error: str) -> str:
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    return (lines[-1] if lines else "no output")[:160]


def _goal(name: str, target: str, status: str, result: str = "") -> dict:
    return {"goal": name, "target": target, "status": status, "result": result}


def cuda_test_goals(folder: Path) -> list[dict]:
    goals = []
    for setting, words in TEST_SETTINGS.items():
        name, target, report = f"cuda tests, {words}", "all pass", folder / f"cuda_tests-{setting}.xml"
        if not report.exists():
            goals.append(_goal(name, target, "not run"))
            continue
        suite = ElementTree.parse(report).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        count = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
        bad = count["failures"] + count["errors"]
        ran = count["tests"] - count["skipped"]
        result = f"{ran - bad} passed, {bad} failed, {count['skipped']} skipped"
        goals.append(_goal(name, target, "met" if ran and not bad else "not met", result))
    return goals


def _rows(dense: dict | None, model: str) -> dict:
    return {row["run"]: row for row in (dense or {}).get("rows", []) if row["model"] == model}


def _flow_row_goal(name: str, target: str, row: dict | None, check) -> dict:
    """A goal on the automatic flow row: not run without it, failed with its error, else ``check(row)``."""
    if row is None:
        return _goal(name, target, "not run")
    if "error" in row:
        return _goal(name, target, "failed", _last_line(row["error"]))
    met, result = check(row)
    return _goal(name, target, "met" if met else "not met", result)


def dense_goals(dense: dict | None) -> list[dict]:
    goals = []
    for model in DENSE_MODELS:
        rows = _rows(dense, model)
        base = rows.get("transformers")
        flow = rows.get("flow") if base is not None else None
        if base is not None and "error" in base:
            flow = {"error": "transformers: " + base["error"]}
        goals.append(_flow_row_goal(f"dense {model}: flow / transformers", ">= 1.15", flow,
                                    lambda row: (row["ratio"] >= 1.15, f"{row['ratio']:.3f}")))
        if model in LARGE_DENSE:
            goals.append(_flow_row_goal(f"dense {model}: share of the bf16 matmul peak", ">= 50%", flow, lambda row: (
                row["peak_fraction"] >= 0.5, f"{100 * row['peak_fraction']:.1f}% ({row['tflops']:.0f} TFLOP/s)")))
        goals.append(_flow_row_goal(f"dense {model}: peak memory", "<= transformers'", flow, lambda row: (
            row["peak_gib"] <= base["peak_gib"], f"{row['peak_gib']:.1f} vs {base['peak_gib']:.1f} GiB")))
        goals.append(_fused_choice_goal(model, rows))
    return goals


def hybrid_goal(dense: dict | None) -> dict:
    """Issue 35's pair: qwen3.5-bench, flow / transformers >= 1.15, flash-linear-attention's kernels on both
    sides (a run where either side fell back to torch's answers nothing)."""
    rows = _rows(dense, HYBRID_MODEL)
    base, flow = rows.get("transformers"), rows.get("flow")
    name, target = f"hybrid {HYBRID_MODEL}: flow / transformers, flash-linear-attention on both", ">= 1.15"
    if base is not None and "error" in base:
        flow = {"error": "transformers: " + base["error"]}
    elif flow is not None and "error" not in flow and {base.get("gated_delta"), flow.get("gated_delta")} != {"fla"}:
        return _goal(name, target, "not run", f"gated delta rule: flow {flow.get('gated_delta')}, transformers "
                                              f"{base.get('gated_delta')}")
    return _flow_row_goal(name, target, flow, lambda row: (row["ratio"] >= 1.15, f"{row['ratio']:.3f}"))


def _fused_choice_goal(model: str, rows: dict) -> dict:
    """Every ADAPTER_CUDA_FUSED choice measured, and the automatic one (the plain flow row) the fastest."""
    name, target = f"dense {model}: the automatic kernels are the fastest choice", "every choice measured"
    auto = rows.get("flow")
    # the automatic row stands for the choice it made where that choice has no row of its own
    choices = {choice: rows.get(f"flow fused={choice}") or (auto if auto and auto.get("fused") == choice else None)
               for choice in FUSED_CHOICES}
    if auto is None or any(row is None for row in choices.values()):
        missing = [c for c, row in choices.items() if row is None]
        return _goal(name, target, "not run", f"not measured: {', '.join(missing) or 'the default'}" if rows else "")
    rates = {c: row.get("tokens_per_second") for c, row in choices.items()}
    result = ", ".join(f"{c} {'failed' if rate is None else f'{rate:.0f}'}" for c, rate in rates.items())
    if "error" in auto:
        return _goal(name, target, "failed", _last_line(auto["error"]))
    best = max(rate for rate in rates.values() if rate is not None)
    met = auto["tokens_per_second"] >= (1 - SPEED_TIE) * best
    return _goal(name, target, "met" if met else "not met", f"auto {auto['tokens_per_second']:.0f}; {result}")


def moe_goals(folder: Path) -> list[dict]:
    goals = []
    for shape, target in (("qwen3-30b-a3b", 1.5), ("small", 1.0)):
        name, record = f"MoE {shape}: flow / transformers", _load(folder / f"moe-{shape}.json")
        if record is None or record.get("shape", shape) != shape:  # a dry run's tiny shape is no answer
            goals.append(_goal(name, f">= {target}", "not run", "" if record is None else f"ran {record['shape']}"))
        elif "error" in record:
            goals.append(_goal(name, f">= {target}", "failed", _last_line(record["error"])))
        else:
            ratio = max(record["flow"]) / max(record["transformers"])
            goals.append(_goal(name, f">= {target}", "met" if ratio >= target else "not met", f"{ratio:.3f}"))
    return goals


def startup_goal(folder: Path) -> dict:
    name, target, record = "start-up: launch to the first iteration, tiny model", "<= 15 s", _load(
        folder / "startup.json")
    if record is None or record.get("device", "cuda") != "cuda":  # a dry run's CPU figure is no answer
        return _goal(name, target, "not run", "" if record is None else f"ran on {record['device']}")
    if not record.get("first_iteration"):
        return _goal(name, target, "failed", "no start-up line in the flow's output")
    seconds = min(record["first_iteration"])
    cache = "cold" if record.get("cold") else "warm"
    return _goal(name, target, "met" if seconds <= 15 else "not met", f"{seconds:.1f} s ({cache} compile cache)")


def _dense_rows(folder: Path) -> dict | None:
    """The rows of every ``dense*.json`` (one per bench/gpu_train.py run), or None where there is none."""
    records = [_load(path) for path in sorted(folder.glob("dense*.json"))]
    return {"rows": [row for record in records for row in record["rows"]]} if records else None


def goals(folder: Path) -> list[dict]:
    dense = _dense_rows(folder)
    return [*cuda_test_goals(folder), *dense_goals(dense), hybrid_goal(dense), *moe_goals(folder),
            startup_goal(folder)]


def markdown(rows: list[dict]) -> str:
    lines = ["| goal | target | status | result |", "| --- | --- | --- | --- |"]
    lines += [f"| {r['goal']} | {r['target']} | {r['status']} | {r['result']} |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    folder = Path(argv[0])
    table = markdown(goals(folder))
    (folder / "goals.md").write_text(table)
    print(table, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""bench/gpu_goals.py: each goal of the GPU issue read off one check's folder as met, not met, failed or not
run, from the files the benches and pytest write there."""

from __future__ import annotations

import json

from bench import gpu_goals


def _junit(path, tests: int, failures: int, skipped: int = 0) -> None:
    path.write_text(f'<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="{tests}" '
                    f'failures="{failures}" errors="0" skipped="{skipped}"/></testsuites>')


def _flow(model: str, run: str, rate: float, **figures) -> dict:
    return {"model": model, "run": run, "tokens_per_second": rate, "ratio": figures.get("ratio", 1.0),
            "tflops": 100.0, "peak_fraction": figures.get("peak_fraction", 0.2), "peak_gib": figures.get("gib", 10.0)}


def _by_goal(folder) -> dict:
    return {row["goal"]: row for row in gpu_goals.goals(folder)}


def test_every_goal_is_not_run_in_an_empty_folder(tmp_path):
    rows = gpu_goals.goals(tmp_path)
    assert rows and {row["status"] for row in rows} == {"not run"}
    assert (tmp_path / "goals.md").exists() is False and gpu_goals.main([str(tmp_path)]) == 0
    assert "| not run |" in (tmp_path / "goals.md").read_text()


def test_cuda_tests_pass_only_with_no_failure_and_something_run(tmp_path):
    _junit(tmp_path / "cuda_tests-liger.xml", tests=8, failures=3)
    _junit(tmp_path / "cuda_tests-no-liger.xml", tests=8, failures=0, skipped=1)
    _junit(tmp_path / "cuda_tests-fused-eager.xml", tests=2, failures=0, skipped=2)
    rows = _by_goal(tmp_path)
    assert (rows["cuda tests, Liger-Kernel installed"]["status"],
            rows["cuda tests, Liger-Kernel installed"]["result"]) == ("not met", "5 passed, 3 failed, 0 skipped")
    assert rows["cuda tests, Liger-Kernel not installed"]["status"] == "met"
    assert rows["cuda tests, ADAPTER_CUDA_FUSED=eager"]["status"] == "not met"  # everything skipped
    assert rows["cuda tests, ADAPTER_CUDA_FUSED=compile"]["status"] == "not run"


def test_dense_goals_read_the_rows_of_each_model(tmp_path):
    small, large = "qwen2.5-0.5b", "qwen2.5-1.5b"
    rows = [_flow(small, "flow", 70000, ratio=1.2, gib=20.0), _flow(small, "transformers", 58000, gib=30.0),
            _flow(small, "flow fused=eager", 50000), _flow(small, "flow fused=compile", 71000),
            {"model": small, "run": "flow fused=liger", "error": "Traceback\nRuntimeError: boom\n"},
            {"model": large, "run": "flow", "error": "...\nRuntimeError: invalid gradient\n"},
            _flow(large, "transformers", 20000)]
    (tmp_path / "dense.json").write_text(json.dumps({"device": "cuda", "peak": 7.8e14, "rows": rows}))
    goals = _by_goal(tmp_path)
    assert goals[f"dense {small}: flow / transformers"]["status"] == "met"
    assert goals[f"dense {small}: peak memory"]["result"] == "20.0 vs 30.0 GiB"
    choice = goals[f"dense {small}: the automatic kernels are the fastest choice"]
    assert choice["status"] == "met"  # 70000 is within 2% of compile's 71000; liger failed
    assert "liger failed" in choice["result"]
    assert goals[f"dense {large}: flow / transformers"] == {
        "goal": f"dense {large}: flow / transformers", "target": ">= 1.15", "status": "failed",
        "result": "RuntimeError: invalid gradient"}
    assert goals[f"dense {large}: share of the bf16 matmul peak"]["status"] == "failed"
    assert goals["dense qwen3-1.7b: flow / transformers"]["status"] == "not run"


def test_a_slower_automatic_choice_is_not_met(tmp_path):
    model = "qwen2.5-0.5b"
    rows = [_flow(model, "flow", 60000), _flow(model, "transformers", 60000),
            *(_flow(model, f"flow fused={c}", rate) for c, rate in (("eager", 50000), ("compile", 66000),
                                                                     ("liger", 60000)))]
    (tmp_path / "dense.json").write_text(json.dumps({"rows": rows}))
    assert _by_goal(tmp_path)[f"dense {model}: the automatic kernels are the fastest choice"]["status"] == "not met"


def test_moe_and_start_up_goals(tmp_path):
    (tmp_path / "moe-small.json").write_text(json.dumps({"flow": [9000, 11000], "transformers": [10000]}))
    (tmp_path / "moe-qwen3-30b-a3b.json").write_text(json.dumps({"error": "flow run failed:\nOOM\n"}))
    (tmp_path / "startup.json").write_text(json.dumps({"device": "cuda", "first_iteration": [18.2, 14.9],
                                                       "cold": False}))
    goals = _by_goal(tmp_path)
    assert (goals["MoE small: flow / transformers"]["status"], goals["MoE small: flow / transformers"]["result"]) == (
        "met", "1.100")
    assert goals["MoE qwen3-30b-a3b: flow / transformers"]["status"] == "failed"
    startup = goals["start-up: launch to the first iteration, tiny model"]
    assert (startup["status"], startup["result"]) == ("met", "14.9 s (warm compile cache)")


def test_figures_from_a_dry_run_on_the_cpu_answer_no_goal(tmp_path):
    (tmp_path / "startup.json").write_text(json.dumps({"device": "cpu", "first_iteration": [5.4]}))
    (tmp_path / "moe-small.json").write_text(json.dumps({"shape": "tiny", "flow": [1.0], "transformers": [1.0]}))
    goals = _by_goal(tmp_path)
    assert goals["start-up: launch to the first iteration, tiny model"]["status"] == "not run"
    assert (goals["MoE small: flow / transformers"]["status"], goals["MoE small: flow / transformers"]["result"]) == (
        "not run", "ran tiny")


def test_the_hybrid_pair_counts_only_with_flash_linear_attention_on_both_sides(tmp_path):
    model, goal = "qwen3.5-bench", "hybrid qwen3.5-bench: flow / transformers, flash-linear-attention on both"
    fla = [{**_flow(model, "flow", 30000, ratio=1.2), "gated_delta": "fla"},
           {**_flow(model, "transformers", 25000), "gated_delta": "fla"}]
    (tmp_path / "dense-hybrid.json").write_text(json.dumps({"rows": fla}))
    assert (_by_goal(tmp_path)[goal]["status"], _by_goal(tmp_path)[goal]["result"]) == ("met", "1.200")
    torch_side = [fla[0], {**fla[1], "gated_delta": "torch"}]
    (tmp_path / "dense-hybrid.json").write_text(json.dumps({"rows": torch_side}))
    assert (_by_goal(tmp_path)[goal]["status"], _by_goal(tmp_path)[goal]["result"]) == (
        "not run", "gated delta rule: flow fla, transformers torch")

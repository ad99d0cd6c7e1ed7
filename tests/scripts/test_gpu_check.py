"""scripts/gpu_check.py, the check a GPU session runs first: every case's code path runs on the CPU
(``--cpu-smoke``: tiny models of each case's architecture, the CLI without llama_cpp and gradio, as on
the GPU machine), a failed case is a line and a result rather than a stop, and without CUDA it says so
in one line."""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
SCRIPT = SCRIPTS / "gpu_check.py"
CASES = ["ppo-7b", "grpo-1.5b", "grpo-1.5b-upcast", "rloo-1.5b", "reward-adapter-1.5b", "resume-1.5b", "ppo-fp16-1.5b",
         "cli-1.5b"]
PHASES = {"generation", "scoring", "update"}


def run(*args, out: Path):
    env = {**os.environ, "OUT": str(out)}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=900, env=env)


def test_cpu_smoke_runs_every_case_and_writes_their_figures(gpu_session_smoke):
    done, out = gpu_session_smoke  # scripts/gpu_session.sh --cpu-smoke: this script first
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [ln for ln in (out / "gpu_check.log").read_text().splitlines() if ln.startswith(("ok ", "FAIL "))]
    assert [ln.split()[:2] for ln in lines] == [["ok", name] for name in CASES]
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["mode"] == "cpu-smoke"
    assert {"torch", "transformers", "peft", "bitsandbytes"} <= set(report)
    for case in report["cases"]:
        assert "error" not in case, case.get("traceback")
        assert set(case["plan"]["phases"]) == set(case["comparison"]) == set(case["measured_gib"]) == PHASES
        assert all(case["seconds"][k] > 0 for k in ("time_generation_s", "time_scoring_s", "time_update_s"))
        assert case["tokens_per_s"]["tokens_per_s_generation"] > 0
        assert case["settings"]["ref.backend"] == "adapter_off" and case["overrides"]
        if case["kind"] != "cli":  # the loop a GPU run samples with (rollout.decoder auto), here eager
            assert case["decoder"] == "static loop, eager"
    by_name = {case["case"]: case for case in report["cases"]}
    assert by_name["grpo-1.5b"]["settings"]["algorithm"] == "grpo" and by_name["rloo-1.5b"]["settings"]["algorithm"] == "rloo"
    upcast = {name: by_name[name]["settings"]["quant.upcast_non_quantized"] for name in ("grpo-1.5b", "grpo-1.5b-upcast")}
    assert upcast == {"grpo-1.5b": False, "grpo-1.5b-upcast": True}  # both dtype settings, side by side
    fp16 = by_name["ppo-fp16-1.5b"]
    assert fp16["settings"]["quant.compute_dtype"] == "fp16" and "loss_scale" in fp16["rows"][-1]  # the GradScaler
    steps = fp16["optimizer_steps"]  # two steps an iteration; the case fails when the scaler skipped them all
    assert steps["steps"] == 2 and steps["taken"] + steps["skipped"] == 2 and steps["taken"] >= 1
    assert all(case["optimizer_steps"]["taken"] >= 1 for case in report["cases"])
    # The 7B first, the rest from the quickest to the slowest by their H200 estimates; within the budget.
    estimates = [case["estimate_s"] for case in report["cases"][1:]]
    assert estimates == sorted(estimates) and "running" not in report
    assert report["estimate_h200_s"] <= 300 - 15  # timeout -k 15 300 in scripts/gpu_session.sh
    # `homerlhf train` decided as on the GPU machine (CUDA reported, the 4090's card), measuring nothing:
    # no llama.cpp there (nor here: absent), the default rates' label of a GPU card.
    (placement,) = by_name["cli-1.5b"]["placement"]
    assert placement.startswith("[homerlhf] placement as configured: ref adapter_off, reward function, rollout hf")
    assert "GPU: H200 figures scaled to the RTX 4090 by its published specs" in placement
    assert by_name["reward-adapter-1.5b"]["settings"]["reward.backend"] == "adapter"
    assert by_name["resume-1.5b"]["state_equal"] and [r["iteration"] for r in by_name["resume-1.5b"]["rows"]] == [2]
    assert by_name["cli-1.5b"]["checkpoints"] == ["iter_000001", "iter_000002"]


def test_cpu_smoke_of_the_largest_model_the_planner_fits(tmp_path):
    done = run("--cpu-smoke", "--largest", "--out", str(tmp_path / "largest.json"), out=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    [case] = json.loads((tmp_path / "largest.json").read_text())["cases"]
    assert case["case"].startswith("largest-") and case["preset"] == "4090" and "error" not in case


def test_a_failing_case_is_a_line_and_the_next_case_still_runs(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    script = runpy.run_path(str(SCRIPT))  # defines everything; main does not run (__name__ is not __main__)
    Case, Run = script["Case"], script["Run"]
    broken = Case("broken", "no-such-preset", "Qwen/Qwen2.5-1.5B", (), 1, 10)
    entry = script["guarded"](broken, Run(smoke=True, tmp=tmp_path))
    assert not list(tmp_path.iterdir())  # refused before any model was built
    assert entry["error"].startswith("UserError: ") and "no-such-preset" in entry["error"]
    assert "Traceback" in entry["traceback"] and entry["overrides"]
    assert script["line"](entry).startswith("FAIL broken")


def test_a_gpu_case_loads_its_model_from_where_the_build_puts_it(monkeypatch, tmp_path):
    """On a GPU the checkpoints are kept in the session's models folder: the path a case configures
    before the build is that folder's (it was the scratch dir's, which the build never wrote)."""
    monkeypatch.syspath_prepend(str(SCRIPTS))
    monkeypatch.setenv("HOMERLHF_GPU_MODELS", str(tmp_path / "models"))
    script = runpy.run_path(str(SCRIPT))
    run = script["Run"](smoke=False, tmp=tmp_path / "scratch")
    assert run.model_dir("Qwen/Qwen2.5-7B", build=False) == tmp_path / "models" / "Qwen--Qwen2.5-7B-seed0"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_one_line_and_nonzero(tmp_path):
    done = run(out=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [done.stderr.strip()] and "needs a CUDA GPU" in done.stderr
    assert "--cpu-smoke" in done.stderr and not (tmp_path / "gpu_check.json").exists()

"""`homerlhf demo --fast` as a user runs it: a subprocess, offline, CPU, real llama.cpp workers, under the
default kernels (from the installed wheel, outside the checkout: tests/wheel_venv.py) and under AVX2 ones
(another CPU's numerics)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import psutil
import pytest


def _worker_processes(*markers: str):
    """homerlhf worker processes (``python -m homerlhf.cli worker ...``, by the module they run, not a
    path that may hold the word) whose command line names one of ``markers`` (this test's run
    directory or model cache): other sessions on the machine may run workers of their own."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if " -m homerlhf.cli worker " in f" {cmd} " and any(m in cmd for m in markers):
            found.append(proc)
    return found


@pytest.mark.slow
def test_demo_fast_end_to_end(tmp_path, installed_wheel):
    out = tmp_path / "demo"
    markers = (str(tmp_path), os.environ.get("HOMERLHF_CACHE", str(tmp_path)))
    before = {p.pid for p in _worker_processes(*markers)}
    proc = installed_wheel.run("demo", "--fast", "--seed", "0", "--out", str(out), cwd=tmp_path, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    # Quiet: llama.cpp's own log (its n_ctx_seq warning, a LoRA buffer-type line per tensor on CPUs with AMX)
    # goes to the run's llama.log, and no FutureWarning of transformers' renamed checkpointing reaches the user.
    printed = proc.stdout + proc.stderr
    assert [line for line in printed.splitlines() if "llama_" in line] == []
    assert "FutureWarning" not in printed
    assert "n_ctx_seq" in (out / "llama.log").read_text()

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == list(range(1, len(rows) + 1)) and len(rows) >= 6
    k = len(rows) // 4
    first = sum(r["score_mean"] for r in rows[:k]) / k
    last = sum(r["score_mean"] for r in rows[-k:]) / k
    # The builtin reward model scores polite + on-topic replies about +3 and the rest about -3;
    # the SFT policy starts near an even mix, so a working PPO moves the mean by well over 1.
    assert last > first + 1.0, (first, last)
    assert all(r["kl_mean"] < 30 for r in rows)
    # The demo's recipe never leaves its reference in one update: no KL flag, no warning line.
    assert [r["kl_flag"] for r in rows] == [0] * len(rows), [r.get("kl_flag_reason") for r in rows]
    assert "leaving its reference" not in proc.stderr

    assert (out / "reward_curve.png").stat().st_size > 10_000
    # The rollouts came from the engine the preset's rollout.engine auto took (no bench figures here: the
    # defaults, which on a CPU with llama-cpp-python take llama.cpp), said in the run's first lines; its
    # samples are the trainer's to float error (docs/demo.md: IS weights 0.99997-1.00003 on every measured run).
    from homerlhf.config import from_yaml_file

    assert from_yaml_file(out / "config.yaml").rollout.engine == "llamacpp"
    assert "rollout engine auto -> llamacpp" in proc.stdout + proc.stderr
    assert all(abs(r["is_weight_mean"] - 1) < 1e-3 and r["kl_behaviour_old"] < 1e-5 for r in rows)
    pairs = [json.loads(line) for line in (out / "before_after.jsonl").read_text().splitlines()]
    # Every held-out prompt, answered before and after PPO, scored by the checker, the RM and fluency.
    keys = {"before", "after", "before_score", "after_score", "before_good", "after_good",
            "before_well_formed", "after_well_formed", "before_truncated", "after_truncated"}
    assert all(keys <= set(p) for p in pairs)
    # Alignment, not reward hacking, as the verdict asks, recomputed from its rows: the task's own
    # checker up by 0.25 on 8 answers to each of the 40 held-out prompts, replies as whole task
    # sentences down by at most 0.05, none cut by the cap, KL within 4 nats/response. The recipe's
    # margin over the verdict's line: +0.30, which every measured run cleared (seeds 0-4, default and
    # AVX2 kernels, AMD EPYC Zen 4: +0.38 to +0.45, either engine; docs/demo.md), so a CPU whose kernels land elsewhere
    # still passes and a recipe that lost its margin does not.
    def mean(key):
        return sum(float(p[key]) for p in pairs) / len(pairs)

    assert len(pairs) == 320
    assert mean("after_good") - mean("before_good") >= 0.30, (mean("before_good"), mean("after_good"))
    assert mean("after_well_formed") >= mean("before_well_formed") - 0.05
    assert mean("after_truncated") <= 0.05, mean("after_truncated")
    assert rows[-1]["kl_mean"] <= 4.0, rows[-1]["kl_mean"]
    md = (out / "before_after.md").read_text()
    # The demo's RL is GRPO: its tables name it (never "after (PPO)")
    assert "| prompt | before GRPO (SFT) | score | after GRPO | score |" in md and "PPO" not in md
    assert "| checker accuracy (polite + on-topic) |" in md
    assert "after (GRPO)" in proc.stdout and "(PPO)" not in proc.stdout
    assert "homerlhf demo summary" in proc.stdout
    assert [line for line in proc.stdout.splitlines() if line.startswith("alignment ")][0].startswith("alignment improved")

    assert {p.pid for p in _worker_processes(*markers)} - before == set()

    # A second demo into the same directory refuses to overwrite it, in one line.
    again = installed_wheel.run("demo", "--fast", "--out", str(out), cwd=tmp_path, timeout=300)
    assert again.returncode != 0 and "--overwrite" in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_demo_fast_improves_with_its_models_built_under_avx2_kernels(tmp_path):
    """Another CPU's numerics on this one: ``ATEN_CPU_CAPABILITY=avx2`` switches PyTorch to the AVX2
    kernels of a machine without AVX-512, and a model cache of its own makes the subprocess build the
    SFT and reward models under them too."""
    out = tmp_path / "demo"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "HOMERLHF_CACHE": str(tmp_path / "cache"),
           "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, "-m", "homerlhf.cli", "demo", "--fast", "--seed", "0", "--out", str(out)],
                          capture_output=True, text=True, timeout=1500, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "torch CPU kernels: AVX2" in proc.stderr + proc.stdout  # the setting took
    assert any((tmp_path / "cache" / "builtin").glob("demo-rm-*")), "the reward model was not built here"

    verdict = [line for line in proc.stdout.splitlines() if line.startswith("alignment ")]
    assert len(verdict) == 1 and verdict[0].startswith("alignment improved"), verdict or proc.stdout[-2000:]
    # The verdict's conditions, from the rows it was computed on (whole-sentence replies down by at most
    # 0.05, on 8 answers to each of the 40 held-out prompts per side), with the recipe's margin: the
    # checker up by 0.30, not only the verdict's 0.25 (above).
    rows = [json.loads(line) for line in (out / "before_after.jsonl").read_text().splitlines()]
    assert len(rows) == 320

    def mean(key):
        return sum(float(r[key]) for r in rows) / len(rows)

    assert mean("after_good") - mean("before_good") >= 0.30, (mean("before_good"), mean("after_good"))
    assert mean("after_well_formed") >= mean("before_well_formed") - 0.05

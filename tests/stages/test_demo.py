"""`homerlhf demo --fast` as a user runs it: a subprocess, offline, CPU, real llama.cpp workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import psutil
import pytest


def _worker_processes():
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if "homerlhf" in cmd and " worker " in f" {cmd} ":
            found.append(proc)
    return found


@pytest.mark.slow
def test_demo_fast_end_to_end(tmp_path):
    out = tmp_path / "demo"
    before = {p.pid for p in _worker_processes()}
    proc = subprocess.run(
        [sys.executable, "-m", "homerlhf.cli", "demo", "--fast", "--seed", "0", "--out", str(out)],
        capture_output=True, text=True, timeout=1500, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == list(range(1, len(rows) + 1)) and len(rows) >= 6
    k = len(rows) // 4
    first = sum(r["score_mean"] for r in rows[:k]) / k
    last = sum(r["score_mean"] for r in rows[-k:]) / k
    # The builtin reward model scores polite + on-topic replies about +3 and the rest about -3;
    # the SFT policy starts near an even mix, so a working PPO moves the mean by well over 1.
    assert last > first + 1.0, (first, last)
    assert all(r["kl_mean"] < 30 for r in rows)

    assert (out / "reward_curve.png").stat().st_size > 10_000
    assert (out / "config.yaml").is_file()
    pairs = [json.loads(line) for line in (out / "before_after.jsonl").read_text().splitlines()]
    # Every held-out prompt, answered before and after PPO, scored by the checker, the RM and fluency.
    keys = {"before", "after", "before_score", "after_score", "before_good", "after_good",
            "before_well_formed", "after_well_formed", "before_truncated", "after_truncated"}
    assert len(pairs) >= 40 and all(keys <= set(p) for p in pairs)
    # Alignment, not reward hacking, in the direction the demo's verdict asks (checker accuracy
    # +0.25, KL <= 4 nats/response, truncated <= 0.2) with looser margins for 8 iterations: the
    # task's own checker improves on the held-out prompts, replies stay mostly whole sentences and
    # end with a stop token, and KL stays bounded.
    def mean(key):
        return sum(float(p[key]) for p in pairs) / len(pairs)

    assert mean("after_good") > mean("before_good"), (mean("before_good"), mean("after_good"))
    assert mean("after_well_formed") >= 0.5, mean("after_well_formed")
    assert mean("after_truncated") <= 0.3, mean("after_truncated")
    assert rows[-1]["kl_mean"] <= 6.0, rows[-1]["kl_mean"]
    md = (out / "before_after.md").read_text()
    assert "| prompt | before PPO" in md and "| checker accuracy (polite + on-topic) |" in md
    assert "homerlhf demo summary" in proc.stdout
    assert "alignment improved" in proc.stdout or "alignment did NOT improve" in proc.stdout

    assert {p.pid for p in _worker_processes()} - before == set()

    # A second demo into the same directory refuses to overwrite it, in one line.
    again = subprocess.run([sys.executable, "-m", "homerlhf.cli", "demo", "--fast", "--out", str(out)],
                           capture_output=True, text=True, timeout=300)
    assert again.returncode != 0 and "--overwrite" in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1

"""benchmarks/peer_grpo.py runs as documented: TRL's GRPOTrainer and our trainer with each rollout engine,
each side in its own process, and one table with the ratio to TRL and the engine ``auto`` takes (a smoke
run on a tiny workload; the figures themselves are the benchmark's, docs/time.md)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp")
pytest.importorskip("trl")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "peer_grpo.py"


@pytest.mark.slow
def test_prints_each_side_the_ratio_and_the_engine_auto_takes(tmp_path):
    env = {**os.environ, "HOMERLHF_CACHE": str(tmp_path / "cache"),  # no bench figures: the defaults choose
           "PYTHONPATH": str(SCRIPT.parents[1])}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--runs", "1", "--steps", "2", "--prompts", "2", "--group", "2",
         "--new-tokens", "4", "--threads", "1"],
        capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert re.search(r"^machine: .+ physical cores", out, re.M)
    assert "rollout engine auto -> llamacpp" in out  # the cpu-tiny preset's auto, by the default rates
    rows = {m.group(1): float(m.group(2)) for m in re.finditer(r"^\s*(trl|ours-hf|ours-llamacpp)\s.*?(\d+\.\d+)x$",
                                                                out, re.M)}
    assert set(rows) == {"trl", "ours-hf", "ours-llamacpp"} and rows["trl"] == 1.0
    assert all(ratio > 0 for ratio in rows.values())
    last = out.strip().splitlines()[-1]
    assert last.startswith("defaults on both sides: rollout.engine auto takes llamacpp here: ")
    assert last.endswith(f"{rows['ours-llamacpp']:.2f}x (<= 0.7x is issue 46's goal)")

"""scripts/gpu_session.sh, what a session lent a GPU runs: two commands, ``check`` (``homerlhf check``, the
installed command's code) and ``speed`` (benchmarks/gpu_generation.py), ``check`` under ``timeout -k 15 300`` and ``speed`` under 200 s, each with its output and
JSON under ``$OUT``, the machine's package versions beside them, a failure in its exit code."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_session.sh"


def test_each_command_runs_its_script_and_leaves_its_results_in_out(gpu_session_smoke):
    done, out = gpu_session_smoke
    for command, name, label in (("check", "gpu_check", "homerlhf check"), ("speed", "gpu_generation", "gpu_generation.py")):
        run = done.each[command]
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        assert f"{label} exit: 0 (" in run.stdout
        assert json.loads((out / f"{name}.json").read_text())["mode"] in ("cpu-smoke", "cpu_smoke")
        assert (out / f"{name}.log").read_text().strip()
    versions = dict(line.split(" ", 1) for line in (out / "environment.txt").read_text().splitlines()
                    if line.split(" ", 1)[0] in ("torch", "transformers", "bitsandbytes"))
    assert set(versions) == {"torch", "transformers", "bitsandbytes"} and "absent" not in versions.values()
    assert json.loads((out / "gpu_generation.json").read_text())["models"]
    text = SCRIPT.read_text()
    assert "limit=300 " in text and "limit=200 " in text and 'timeout -k 15 "$limit" "$PYTHON"' in text and "${PYTHON:-python3}" in text
    assert "run=(-m homerlhf.cli check --overwrite)" in text  # our GPU contact runs the code a user runs


def test_a_command_it_does_not_know_is_one_line_and_nonzero(tmp_path):
    done = subprocess.run(["bash", str(SCRIPT), "all"], capture_output=True, text=True, timeout=60,
                          env={"OUT": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 2 and done.stderr.startswith("usage: bash scripts/gpu_session.sh check|speed")
    assert not list(tmp_path.iterdir())

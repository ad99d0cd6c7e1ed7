"""scripts/gpu_session.sh, the one command a session lent a GPU runs: both GPU scripts in turn, their
output and JSON under ``$OUT``, the machine's package versions beside them, a failure in its exit code."""

from __future__ import annotations

import json


def test_cpu_smoke_runs_both_scripts_and_leaves_their_results_in_out(gpu_session_smoke):
    done, out = gpu_session_smoke
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "gpu_check.py exit: 0" in done.stdout and "gpu_generation.py exit: 0" in done.stdout
    assert {p.name for p in out.iterdir()} >= {"environment.txt", "gpu_check.log", "gpu_check.json",
                                              "gpu_generation.log", "gpu_generation.json"}
    versions = dict(line.split(" ", 1) for line in (out / "environment.txt").read_text().splitlines()
                    if line.split(" ", 1)[0] in ("torch", "transformers", "bitsandbytes"))
    assert set(versions) == {"torch", "transformers", "bitsandbytes"} and "absent" not in versions.values()
    assert json.loads((out / "gpu_check.json").read_text())["mode"] == "cpu-smoke"
    assert json.loads((out / "gpu_generation.json").read_text())["models"]

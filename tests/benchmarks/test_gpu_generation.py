"""benchmarks/gpu_generation.py: its CPU smoke mode runs every part a GPU session will (the three
rates, interleaved rounds, the agreement check, a PPO iteration with the static loop and HF's
predicted one) on a tiny model, so the GPU run works first time; without CUDA and without a CPU
mode, one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_generation.py"


def test_cpu_smoke_runs_every_part(gpu_session_smoke):
    done, out = gpu_session_smoke  # scripts/gpu_session.sh --cpu-smoke: after `homerlhf check`
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "gpu_generation.py exit: 0" in done.stdout
    report = json.loads((out / "gpu_generation.json").read_text())
    (row,) = report["models"]
    assert row["planned_chunk"] == 4 and row["chunk_source"] == "--chunk"
    assert set(row["rates"]) == {"hf@2", "hf@4", "static@4"}
    for label, rate in row["rates"].items():
        assert "error" not in rate, (label, rate)
        assert rate["rows"] == int(label.split("@")[1]) and rate["generated_tokens"] > 0
        assert rate["kv_repeated_layer_passes"] == 0, (label, rate)  # the same attention path: K/V read once
        assert rate["kv_repeated_decode_layer_passes"] == rate["kv_repeated_prefill_layer_passes"] == 0
        assert rate["sessions_built"] == 0 and rate["captured_replays"] == 0  # warmed up untimed; eager here
    assert row["interleaved"]["rounds"] == 1 and row["interleaved"]["samples_equal"] is True
    # On the CPU (fp32) the loop is exact: every row equal, behaviour log-probs the trainer's own.
    agreement = row["agreement"]
    assert agreement["rows_all_equal"] == agreement["rows"] == 2
    assert agreement["max_behaviour_gap_on_prefix"] <= 1e-5 and agreement["max_behaviour_vs_old"] <= 1e-4
    assert abs(agreement["is_weight_mean"] - 1.0) <= 1e-4
    static, hf = row["iteration"]["static"], row["iteration"]["hf"]
    assert static["decoder"] == "static" and static["time_iteration_s"] > 0 and static["rollout_chunk_size"] == 4
    assert hf["predicted"] and hf["chunk"] == 2
    assert "PPO iteration, static @ chunk 4" in (out / "gpu_generation.log").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_one_line_and_nonzero(tmp_path, capsys):
    import runpy

    module = runpy.run_path(str(SCRIPT))  # defines main without running it
    with pytest.raises(SystemExit) as info:
        module["main"](["--out", str(tmp_path / "x.json")])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "needs a CUDA GPU" in err
    assert not (tmp_path / "x.json").exists()


def test_a_row_that_fails_is_a_nonzero_exit(tmp_path, capsys):
    """A setting that errors (here HF generate at chunk 0: no rows) is a figure, not a crash: the other
    settings still run, the model's line says FAIL and the exit status is 1 (it was 0)."""
    import runpy

    module = runpy.run_path(str(SCRIPT))
    code = module["main"](["--cpu-smoke", "--hf-chunk", "0", "--rounds", "0", "--iteration-models", "",
                           "--out", str(tmp_path / "g.json")])
    out = capsys.readouterr().out
    assert code == 1 and "FAIL builtin-tiny" in out and out.rstrip().endswith("FAIL: builtin-tiny")
    (row,) = json.loads((tmp_path / "g.json").read_text())["models"]
    assert "error" in row["rates"]["hf@0"] and "error" not in row["rates"]["static@4"]

"""Each tracker keeps every iteration's sample table, not only the last one's: three steps logged in
process, then read back from the tracker's own local files (W&B offline: the increments of its one
incremental table; MLflow: an artifact per step; TensorBoard: a text per step; Trackio: a table per step
in its database). The rows come back as logged, the rank column with them."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from homerlhf.tracking.backends import BACKENDS, SAMPLE_COLUMNS, RunInfo

STEPS = (1, 2, 3)


def _samples(step: int) -> list[dict]:
    return [{"prompt": f"prompt {step}", "response": f"answer {step}.{i}", "score": 0.25 * i - step,
             "truncated": i == 1, "rank": rank} for i, rank in enumerate(("first", "top", "bottom"))]


def _expected(step: int) -> list[list]:
    return [[step, s["prompt"], s["response"], s["score"], s["truncated"], s["rank"]] for s in _samples(step)]


def _log_three_steps(run_dir: Path, name: str) -> RunInfo:
    info = RunInfo(run_dir, "homerlhf", f"tables-{run_dir.parent.name}", {"ppo.iterations": 3}, first_step=1)
    tracker = BACKENDS[name](info)
    for step in STEPS:
        tracker.log(step, {"score_mean": float(step), "iteration": float(step)}, _samples(step))
    tracker.close()
    return info


def _wandb_rows(run_dir: Path, info: RunInfo) -> dict[int, list[list]]:
    from homerlhf.tracking.wandb_log import run_files, run_history

    files = run_files(run_dir / "wandb", info.ids["wandb"])[0].parent / "files"
    out, increments = {}, []
    for step, items in run_history(run_dir / "wandb", info.ids["wandb"]):
        assert items["samples/log_mode"] == "INCREMENTAL" and items["samples/nrows"] == 3 * step  # all rows so far
        increments.append(items["samples/increment_num"])
        out[step] = json.loads((files / items["samples/path"]).read_text())["data"]  # the rows this step added
    assert increments == [0, 1, 2]
    return out


def _mlflow_rows(run_dir: Path, info: RunInfo, tmp: Path) -> dict[int, list[list]]:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    out = {}
    for step in STEPS:
        table = json.loads(Path(client.download_artifacts(info.ids["mlflow"], f"samples_{step}.json", str(tmp)))
                           .read_text())
        assert table["columns"] == list(SAMPLE_COLUMNS)
        out[step] = table["data"]
    return out


def _tensorboard_rows(run_dir: Path) -> dict[int, list[list]]:
    from tracker_readback import tensorboard_values

    texts = tensorboard_values(run_dir / "tensorboard")["samples/text_summary"]
    out = {}
    for step, (text,) in texts.items():
        lines = text.decode().splitlines()[2:]  # the markdown table's header and rule
        out[step] = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]
    return out


def _trackio_rows(run_dir: Path, info: RunInfo) -> dict[int, list[list]]:
    from homerlhf.tracking.settings import trackio_dir

    # trackio binds its directory once per process: this run's rows are those of its run name there.
    with sqlite3.connect(trackio_dir(run_dir) / "homerlhf.db") as con:
        rows = con.execute("SELECT step, metrics FROM metrics WHERE run_name = ? ORDER BY id",
                           (info.run_name,)).fetchall()
    return {step: [[r[c] for c in SAMPLE_COLUMNS] for r in json.loads(metrics)["samples"]["_value"]]
            for step, metrics in rows}


@pytest.mark.parametrize("name", ["wandb", "mlflow", "tensorboard", "trackio"])
def test_every_iterations_sample_rows_stay_in_the_tracker(name, tmp_path, offline_trackers):
    pytest.importorskip({"tensorboard": "tensorboard"}.get(name, name))
    run_dir = tmp_path / "run"
    info = _log_three_steps(run_dir, name)
    if name == "wandb":
        rows = _wandb_rows(run_dir, info)
    elif name == "mlflow":
        rows = _mlflow_rows(run_dir, info, tmp_path)
    elif name == "tensorboard":
        rows = _tensorboard_rows(run_dir)
        assert rows == {step: [[str(v) for v in row] for row in _expected(step)] for step in STEPS}
        return
    else:
        rows = _trackio_rows(run_dir, info)
    assert rows == {step: _expected(step) for step in STEPS}


def test_a_wandb_without_incremental_tables_logs_every_row_so_far_each_step(tmp_path, offline_trackers, monkeypatch):
    """An older wandb (no ``log_mode``): each step's table holds the rows of that step and all before it."""
    pytest.importorskip("wandb")
    from homerlhf.tracking import backends
    from homerlhf.tracking.wandb_log import run_files, run_history

    monkeypatch.setattr(backends, "_log_modes", lambda: ())
    info = _log_three_steps(tmp_path / "run", "wandb")
    files = run_files(tmp_path / "run" / "wandb", info.ids["wandb"])[0].parent / "files"
    for step, items in run_history(tmp_path / "run" / "wandb", info.ids["wandb"]):
        table = json.loads((files / items["samples/path"]).read_text())
        assert table["data"] == [row for s in range(1, step + 1) for row in _expected(s)]

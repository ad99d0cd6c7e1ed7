"""Reading a run back from each tracker's own local files, as a user's tools would find it.

- TensorBoard: the ``EventAccumulator`` its dashboard loads runs with (the plugin one);
- Trackio: its SQLite database (``<dir>/<project>.db``, table ``metrics``), read with sqlite3: the
  trackio module binds its directory at import, once per process;
- W&B: the run's transaction logs (``homerlhf.tracking.wandb_log``: W&B has no reader of its own);
- MLflow: ``MlflowClient`` on the file store.

Each returns ``{key: {step: [values]}}``: a step logged twice shows as two values.
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections import defaultdict
from pathlib import Path

WALL_TIME = ("time_", "tokens_per_s_", "peak_mem_")  # differ between a run and its redo


def _nested():
    return defaultdict(lambda: defaultdict(list))


def tensorboard_values(log_dir: Path) -> dict:
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    acc = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    acc.Reload()
    out = _nested()
    for tag in acc.Tags()["tensors"]:
        for event in acc.Tensors(tag):
            value = tensor_util.make_ndarray(event.tensor_proto)
            out[tag][event.step].append(value.item() if value.size == 1 else value.tolist())
    return out


def trackio_values(trackio_dir: Path, project: str = "homerlhf") -> dict:
    out = _nested()
    with sqlite3.connect(trackio_dir / f"{project}.db") as con:
        for step, metrics in con.execute("SELECT step, metrics FROM metrics ORDER BY id"):
            for key, value in json.loads(metrics).items():
                out[key][step].append(value)
    return out


def wandb_values(wandb_dir: Path, run_id: str) -> dict:
    from homerlhf.tracking.wandb_log import run_history

    out = _nested()
    for step, items in run_history(wandb_dir, run_id):
        for key, value in items.items():
            if not key.startswith("_"):
                out[key][step].append(value)
    return out


def mlflow_values(uri: str, run_id: str) -> dict:
    from mlflow import MlflowClient

    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    client = MlflowClient(tracking_uri=uri)
    out = _nested()
    for key in client.get_run(run_id).data.metrics:
        for metric in client.get_metric_history(run_id, key):
            out[key][metric.step].append(metric.value)
    return out


def mlflow_sample_rows(uri: str, run_id: str, tmp: Path) -> list[dict]:
    """The rows of every sample table of an MLflow run (one ``samples_<step>.json`` artifact per step), as dicts."""
    from mlflow import MlflowClient

    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    client = MlflowClient(tracking_uri=uri)
    tmp.mkdir(parents=True, exist_ok=True)
    rows = []
    for artifact in client.list_artifacts(run_id):
        if artifact.path.startswith("samples_") and artifact.path.endswith(".json"):
            table = json.loads(Path(client.download_artifacts(run_id, artifact.path, str(tmp))).read_text())
            rows += [dict(zip(table["columns"], row)) for row in table["data"]]
    return rows


def all_values(run_dir: Path) -> dict:
    """tracker -> ``{key: {step: [values]}}`` for each tracker of the run at ``run_dir`` (default places)."""
    state = json.loads((run_dir / "tracking.json").read_text())
    return {
        "tensorboard": tensorboard_values(run_dir / "tensorboard"),
        "trackio": trackio_values(run_dir / "trackio"),
        "wandb": wandb_values(run_dir / "wandb", state["ids"]["wandb"]),
        "mlflow": mlflow_values((run_dir / "mlruns").resolve().as_uri(), state["ids"]["mlflow"]),
    }

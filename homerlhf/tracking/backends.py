"""One class per tracker, each the same four things: start (or continue) the run, ``last_step`` (the
highest step the tracker already holds for it), ``log`` a step's metrics and sample generations,
``close``. Each imports its tracker when it is built, never before.

A step is logged once: the session (:mod:`.session`) only hands a tracker steps above its
``last_step``. None of them can rewrite a step (TensorBoard's ``purge_step`` is not applied by every
reader of its files), so the steps a killed run logged after its last checkpoint keep their first values.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

from homerlhf.tracking import settings, wandb_log

SAMPLE_COLUMNS = ("iteration", "prompt", "response", "score", "truncated")


@dataclass
class RunInfo:
    """What every tracker is started with. ``ids``: the trackers' own run ids, kept in the run dir's
    ``tracking.json`` (a tracker records a new one here)."""

    run_dir: Path
    project: str
    run_name: str
    params: dict[str, Any]
    first_step: int  # the first step this process logs (a resumed run: the checkpoint's + 1)
    ids: dict[str, str] = field(default_factory=dict)


def _sample_rows(step: int, samples: list[dict]) -> list[list]:
    return [[step, s.get("prompt"), s.get("response"), s.get("score"), s.get("truncated")] for s in samples]


@contextlib.contextmanager
def scoped_env(**values: Optional[str]) -> Iterator[None]:
    """Environment variables set (None: left as they are) for the block only."""
    before = {key: os.environ.get(key) for key in values}
    os.environ.update({key: value for key, value in values.items() if value is not None})
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, info: RunInfo):
        from torch.utils.tensorboard import SummaryWriter

        log_dir = info.run_dir / "tensorboard"
        self.last_step = _last_event_step(log_dir)
        self.writer = SummaryWriter(str(log_dir))
        if not self.last_step:
            params = "\n".join(f"    {key}: {value}" for key, value in info.params.items())
            self.writer.add_text("config", params, 0)

    def log(self, step: int, metrics: dict[str, float], samples: list[dict]) -> None:
        for key, value in metrics.items():  # float64 tensors: the values exactly as in metrics.jsonl
            self.writer.add_scalar(key, value, step, new_style=True, double_precision=True)
        if samples:
            head = "| " + " | ".join(SAMPLE_COLUMNS) + " |\n|" + "---|" * len(SAMPLE_COLUMNS) + "\n"
            body = "".join("| " + " | ".join(str(v).replace("|", "\\|").replace("\n", " ") for v in row) + " |\n"
                           for row in _sample_rows(step, samples))
            self.writer.add_text("samples", head + body, step)
        self.writer.flush()  # on disk before the step's checkpoint

    def close(self) -> None:
        self.writer.close()


def _last_event_step(log_dir: Path) -> int:
    """The highest step of any summary in the event files of ``log_dir`` (0: none)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    steps = [event.step for path in sorted(log_dir.glob("events.out.tfevents.*"))
             for event in EventFileLoader(str(path)).Load() if event.HasField("summary")]
    return max(steps, default=0)


class TrackioTracker:
    name = "trackio"

    def __init__(self, info: RunInfo):
        # trackio reads TRACKIO_DIR once, when it is first imported.
        with scoped_env(TRACKIO_DIR=str(settings.trackio_dir(info.run_dir))):
            import trackio
        self._trackio = trackio
        # embed=False: no dashboard server (in a notebook trackio would start one, shared publicly on
        # Colab); no system-metrics threads.
        self.run = trackio.init(project=info.project, name=info.run_name, config=info.params, resume="allow",
                                embed=False, auto_log_cpu=False, auto_log_gpu=False)
        self.last_step = max(self.run._next_step - 1, 0)  # trackio's own view: the run's highest step + 1

    def log(self, step: int, metrics: dict[str, float], samples: list[dict]) -> None:
        row: dict[str, Any] = dict(metrics)
        if samples:
            import pandas as pd

            row["samples"] = self._trackio.Table(dataframe=pd.DataFrame(_sample_rows(step, samples),
                                                                        columns=list(SAMPLE_COLUMNS)))
        self.run.log(row, step=step)

    def close(self) -> None:
        self.run.finish()


class WandbTracker:
    name = "wandb"

    def __init__(self, info: RunInfo):
        import wandb

        self._wandb = wandb
        run_id = info.ids.setdefault("wandb", uuid.uuid4().hex[:8])
        # x_disable_meta: no command line (a --set token) or host facts in the run's files.
        self.run = wandb.init(project=info.project, name=info.run_name, id=run_id, resume="allow",
                              dir=str(info.run_dir), mode=settings.wandb_mode(), config=info.params,
                              reinit="create_new", settings=wandb.Settings(x_disable_meta=True, silent=True))
        self.last_step = wandb_log.last_step(info.run_dir / "wandb", run_id)

    def log(self, step: int, metrics: dict[str, float], samples: list[dict]) -> None:
        row: dict[str, Any] = dict(metrics)
        if samples:
            row["samples"] = self._wandb.Table(columns=list(SAMPLE_COLUMNS), data=_sample_rows(step, samples))
        self.run.log(row, step=step)

    def close(self) -> None:
        self.run.finish()
        if self._wandb.run is None:  # no run of the user's left: stop the wandb-core service process
            self._wandb.teardown()


class MlflowTracker:
    name = "mlflow"

    def __init__(self, info: RunInfo):
        from mlflow import MlflowClient

        uri = settings.mlflow_uri(info.run_dir)
        # MLflow 3 refuses its file store unless asked (a database needs the full mlflow package).
        with scoped_env(MLFLOW_ALLOW_FILE_STORE="true" if uri.startswith("file:") else None):
            self.client = MlflowClient(tracking_uri=uri)
            experiment = self.client.get_experiment_by_name(info.project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(info.project)
        run = self._existing(info.ids.get("mlflow"))
        if run is None:
            run = self.client.create_run(experiment_id, run_name=info.run_name,
                                         tags={"homerlhf.run_dir": str(info.run_dir.resolve())})
            self._log_params(run.info.run_id, info.params)
        else:
            self.client.update_run(run.info.run_id, status="RUNNING")
        self.run_id = info.ids["mlflow"] = run.info.run_id
        history = self.client.get_metric_history(self.run_id, "iteration")  # logged with every step
        self.last_step = max((m.step for m in history), default=0)

    def _existing(self, run_id: Optional[str]):
        from mlflow.exceptions import MlflowException

        if not run_id:
            return None
        try:
            return self.client.get_run(run_id)
        except MlflowException:  # the store moved (another MLFLOW_TRACKING_URI): a new run there
            return None

    def _log_params(self, run_id: str, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(key, str(value)[:6000]) for key, value in params.items()]
        for start in range(0, len(items), 100):  # MLflow takes at most 100 params a call
            self.client.log_batch(run_id, params=items[start:start + 100])

    def log(self, step: int, metrics: dict[str, float], samples: list[dict]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()])
        if samples:  # one table artifact, the rows of every step appended (read back first: no progress bar)
            rows = _sample_rows(step, samples)
            with scoped_env(MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR="false"):
                self.client.log_table(self.run_id, {c: [r[i] for r in rows] for i, c in enumerate(SAMPLE_COLUMNS)},
                                      "samples.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


BACKENDS = {cls.name: cls for cls in (TensorBoardTracker, TrackioTracker, WandbTracker, MlflowTracker)}

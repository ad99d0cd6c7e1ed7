"""One class per tracker, each the same things: start (or continue) the run, ``last_step`` (the
highest step the tracker already holds whole for it), ``partial`` (what a kill left of the steps
above it), ``log`` a step's metrics and sample generations, ``close``. Each imports its tracker when
it is built, never before.

A step is logged once: the session (:mod:`.session`) only hands a tracker steps above its
``last_step``, and of those only the metrics (and sample table) ``partial`` says it lacks. None of
them can rewrite a step (TensorBoard's ``purge_step`` is not applied by every reader of its files), so
the steps a killed run logged after its last checkpoint keep their first values.

Whole or partial: TensorBoard and MLflow write a step as many records, one after another, so a kill
can land between two of them. They write the step's ``MARKER`` metric last; a step counts as held
whole once its marker is there, and the metrics (and the ``SAMPLES`` table) found at a later step
are its ``partial``. Trackio (one SQLite row per step, in a transaction) and W&B (one history record
per step; a torn record is not read back) hold a step whole or not at all: their ``partial`` is empty.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

from homerlhf.tracking import settings, wandb_log

SAMPLE_COLUMNS = ("iteration", "prompt", "response", "score", "truncated", "rank")
MARKER = "iteration"  # logged with every step, and last: the step is whole once it is there
SAMPLES = "samples"  # in ``partial``: the step's sample table is there
Partial = dict[int, set[str]]  # step -> the metric keys (and SAMPLES) held at that step
SAMPLES_FILE = re.compile(r"samples_(\d+)\.json")  # MLflow: a step's sample table


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
    """A step's samples as table rows (``SAMPLE_COLUMNS``); a sample without a rank is one of the first."""
    return [[step, s.get("prompt"), s.get("response"), s.get("score"), s.get("truncated"), s.get("rank", "first")]
            for s in samples]


def held_steps(keys_by_step: Partial) -> tuple[int, Partial]:
    """``(last_step, partial)`` from the keys a tracker holds at each step: the highest step with its
    ``MARKER`` (0: none), and the keys of the steps above it."""
    last = max((step for step, keys in keys_by_step.items() if MARKER in keys), default=0)
    return last, {step: set(keys) for step, keys in keys_by_step.items() if step > last}


def _marker_last(metrics: dict[str, float]) -> tuple[dict[str, float], dict[str, float]]:
    """``metrics`` as (all but the marker, the marker alone): the order a step is written in."""
    return ({k: v for k, v in metrics.items() if k != MARKER},
            {k: v for k, v in metrics.items() if k == MARKER})


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
        keys_by_step = _event_tags(log_dir)
        self.last_step, self.partial = held_steps(keys_by_step)
        self.writer = SummaryWriter(str(log_dir))
        if "config" not in keys_by_step.get(0, ()):
            params = "\n".join(f"    {key}: {value}" for key, value in info.params.items())
            self.writer.add_text("config", params, 0)

    def log(self, step: int, metrics: dict[str, float], samples: list[dict]) -> None:
        # One event each, appended to the file in this order (one writer thread): the marker last.
        rest, marker = _marker_last(metrics)
        for key, value in rest.items():  # float64 tensors: the values exactly as in metrics.jsonl
            self.writer.add_scalar(key, value, step, new_style=True, double_precision=True)
        if samples:
            head = "| " + " | ".join(SAMPLE_COLUMNS) + " |\n|" + "---|" * len(SAMPLE_COLUMNS) + "\n"
            body = "".join("| " + " | ".join(str(v).replace("|", "\\|").replace("\n", " ") for v in row) + " |\n"
                           for row in _sample_rows(step, samples))
            self.writer.add_text(SAMPLES, head + body, step)
        for key, value in marker.items():
            self.writer.add_scalar(key, value, step, new_style=True, double_precision=True)
        self.writer.flush()  # on disk before the step's checkpoint

    def close(self) -> None:
        self.writer.close()


def _event_tags(log_dir: Path) -> Partial:
    """The tags (a text's without its ``/text_summary``) of the summaries at each step in the event
    files of ``log_dir``. A file a kill cut short is read up to its last whole event."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    tags: Partial = {}
    for path in sorted(log_dir.glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            if event.HasField("summary"):
                tags.setdefault(event.step, set()).update(
                    value.tag.removesuffix("/text_summary") for value in event.summary.value)
    return tags


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
        self.partial: Partial = {}  # a step is one row (the table in it), inserted in a transaction

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
        self.partial: Partial = {}  # a step is one history record (the table in it), read back whole or not
        self.table = self._new_table([])

    def _new_table(self, rows: list[list]):
        """The samples table that keeps every step's rows: an incremental one (each log adds the step's rows
        to it, W&B shows them all) where this wandb has them, else a table of all rows so far. A resumed
        run starts a new one: the rows of the steps before it stay in the tables logged then."""
        if "INCREMENTAL" in _log_modes():
            return self._wandb.Table(columns=list(SAMPLE_COLUMNS), data=rows, log_mode="INCREMENTAL")
        return self._wandb.Table(columns=list(SAMPLE_COLUMNS), data=rows)

    def log(self, step: int, metrics: dict[str, float], samples: list[dict]) -> None:
        row: dict[str, Any] = dict(metrics)
        if samples:
            rows = _sample_rows(step, samples)
            if getattr(self.table, "log_mode", None) == "INCREMENTAL":
                for sample in rows:
                    self.table.add_data(*sample)
            else:  # an immutable table: a new one, every row so far
                self.table = self._new_table([*self.table.data, *rows])
            row["samples"] = self.table
        self.run.log(row, step=step)

    def close(self) -> None:
        self.run.finish()
        if self._wandb.run is None:  # no run of the user's left: stop the wandb-core service process
            self._wandb.teardown()


def _log_modes() -> tuple[str, ...]:
    """The table log modes the installed wandb knows (none before it had ``log_mode``)."""
    from typing import get_args

    from wandb.sdk.data_types import table

    return get_args(getattr(table, "LogMode", ()))


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
        self.last_step, self.partial = self._held()

    def _held(self) -> tuple[int, Partial]:
        """``(last_step, partial)``: the marker's highest step; the metrics logged above it (a key's
        history is read only if its latest step is above it) and the sample table's rows above it."""
        last = max((m.step for m in self.client.get_metric_history(self.run_id, MARKER)), default=0)
        latest = self.client.get_run(self.run_id).data.to_proto().metrics  # each key at its highest step
        partial: Partial = {}
        for key in sorted({m.key for m in latest if m.step > last}):
            for metric in self.client.get_metric_history(self.run_id, key):
                if metric.step > last:
                    partial.setdefault(metric.step, set()).add(key)
        for step in self._table_steps():
            if step > last:
                partial.setdefault(step, set()).add(SAMPLES)
        return last, partial

    def _table_steps(self) -> set[int]:
        """The steps whose sample table the run holds: one ``samples_<step>.json`` each (and the rows of the
        one ``samples.json`` where a run logged all steps in one table)."""
        names = {f.path for f in self.client.list_artifacts(self.run_id)}
        steps = {int(m.group(1)) for m in map(SAMPLES_FILE.fullmatch, names) if m}
        if "samples.json" in names:
            with tempfile.TemporaryDirectory() as tmp:
                table = json.loads(Path(self.client.download_artifacts(self.run_id, "samples.json", tmp)).read_text())
            column = table["columns"].index("iteration")
            steps |= {int(row[column]) for row in table["data"]}
        return steps

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

        # A kill can cut a step (the file store writes a batch a metric at a time), so it is written in
        # order: the metrics, the table, the marker; synchronous (MLFLOW_ENABLE_ASYNC_LOGGING aside):
        # in that order, and stored before the step's checkpoint.
        now = int(time.time() * 1000)
        rest, marker = _marker_last(metrics)
        if rest:
            self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in rest.items()],
                                  synchronous=True)
        if samples:  # a table artifact per step (samples_<step>.json): each step's as it was, none rewritten
            rows = _sample_rows(step, samples)
            with scoped_env(MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR="false"):
                self.client.log_table(self.run_id, {c: [r[i] for r in rows] for i, c in enumerate(SAMPLE_COLUMNS)},
                                      f"samples_{step}.json")
        if marker:
            self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in marker.items()],
                                  synchronous=True)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


BACKENDS = {cls.name: cls for cls in (TensorBoardTracker, TrackioTracker, WandbTracker, MlflowTracker)}

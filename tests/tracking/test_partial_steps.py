"""A kill between the writes of one step, in process, fast: TensorBoard and MLflow write a step as
many records (an event, a metric-file line per metric; the sample table), so a kill can leave step 3
with some of them written and the rest not, as it once left MLflow's ``iteration`` at step 3 without
``tokens_per_s_scoring``, and the resumed run skipped the step.

Each write of step 3 is cut in turn: that write raises ``Killed`` (a BaseException: nothing catches it,
as nothing runs after a kill; nothing is closed), after the writes before it went through. The logs
are then cut back to the checkpoint at 2 (as ``--resume`` does) and 3..4 logged again (3 redone with
other values): every metric and the sample table at steps 1..4, exactly once each; a step written
whole keeps its first values.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from homerlhf.config import load_config

SAMPLE = [{"prompt": "p", "response": "r", "score": 0.0, "truncated": False}]
KEYS = ("iteration", "score_mean", "tokens_per_s_scoring", "time_iteration_s")
WRITES_PER_STEP = len(KEYS) + 1  # a record per metric, one for the sample table


class Killed(BaseException):
    """The process dies here."""


def _row(step: int, value: float) -> dict:
    return {"iteration": step, "score_mean": value, "tokens_per_s_scoring": 10 * value,
            "time_iteration_s": value / 10, "peak_mem_kind": "cpu_rss"}


def _writes(tracker: str) -> list[tuple[type, str]]:
    """The calls that each write one record of a step."""
    if tracker == "mlflow":
        from mlflow.store.artifact.local_artifact_repo import LocalArtifactRepository
        from mlflow.store.tracking.file_store import FileStore

        return [(FileStore, "_log_run_metric"), (LocalArtifactRepository, "log_artifact")]
    from torch.utils.tensorboard import SummaryWriter

    return [(SummaryWriter, "add_scalar"), (SummaryWriter, "add_text")]


def _cut_after(patch: pytest.MonkeyPatch, tracker: str, done: int) -> list[int]:
    """Let ``done`` writes through, then raise ``Killed`` at the next. Returns the writes counter."""
    count = [0]
    for owner, name in _writes(tracker):
        def cut(*args, _original=getattr(owner, name), **kwargs):
            if count[0] == done:
                raise Killed
            count[0] += 1
            return _original(*args, **kwargs)

        patch.setattr(owner, name, cut)
    return count


def _read_back(run_dir: Path, tracker: str) -> tuple[dict, dict[int, int]]:
    """``({key: {step: [values]}}, {step: sample tables or table rows})`` as the tracker holds them."""
    from collections import Counter

    from tracker_readback import mlflow_sample_rows, mlflow_values, tensorboard_values

    if tracker == "tensorboard":
        values = tensorboard_values(run_dir / "tensorboard")
        return values, {step: len(v) for step, v in values["samples/text_summary"].items()}
    uri = (run_dir / "mlruns").resolve().as_uri()
    run_id = json.loads((run_dir / "tracking.json").read_text())["ids"]["mlflow"]
    values = mlflow_values(uri, run_id)
    return values, dict(Counter(row["iteration"] for row in mlflow_sample_rows(uri, run_id, run_dir / "tables")))


@pytest.mark.parametrize("done", range(WRITES_PER_STEP + 1))
@pytest.mark.parametrize("tracker", ["mlflow", "tensorboard"])
def test_a_step_cut_by_a_kill_is_completed_once_by_the_resumed_run(tmp_path, offline_trackers, monkeypatch,
                                                                   tracker, done):
    from homerlhf.ppo.checkpoint import log_offsets
    from homerlhf.ppo.metrics import MetricsWriter
    from homerlhf.ppo.resuming import truncate_logs

    cfg = load_config("cpu-tiny", overrides=[f"logging.report_to={tracker}"])
    writer = MetricsWriter(tmp_path, cfg)
    for step in (1, 2):
        writer.log(_row(step, float(step)), SAMPLE)
    offsets = log_offsets(tmp_path)  # the checkpoint at 2
    with monkeypatch.context() as patch:
        count = _cut_after(patch, tracker, done)
        try:
            writer.log(_row(3, 3.0), SAMPLE)
        except Killed:
            pass
    assert count[0] == done  # the kill landed after exactly `done` of step 3's writes
    if tracker == "tensorboard":  # what the writer thread had taken reaches the file, as the OS would keep it
        writer.trackers.trackers[0].writer.flush()
    truncate_logs(tmp_path, offsets)

    resumed = MetricsWriter(tmp_path, cfg)
    for step, value in ((3, 30.0), (4, 4.0)):
        resumed.log(_row(step, value), SAMPLE)
    resumed.close()
    values, tables = _read_back(tmp_path, tracker)
    for key in KEYS:
        assert {step: len(v) for step, v in values[key].items()} == {1: 1, 2: 1, 3: 1, 4: 1}, (key, dict(values[key]))
        assert values[key][3][0] in (_row(3, 3.0)[key], _row(3, 30.0)[key])
        if done == WRITES_PER_STEP:  # step 3 was whole before the kill: kept as first logged
            assert values[key][3][0] == _row(3, 3.0)[key]
    assert tables == {1: 1, 2: 1, 3: 1, 4: 1}
    if tracker == "tensorboard":
        assert {step: len(v) for step, v in values["config/text_summary"].items()} == {0: 1}  # not again on resume

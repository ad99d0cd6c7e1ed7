"""PPO runs reporting to all four trackers at once, end to end through the real CLI, read back from
each tracker's own local files (``tracker_readback.py``):

- a straight run: every metric of every iteration, the same numbers as ``metrics.jsonl``, steps
  1..N once each; the sample generations as a table at each step; the run config as parameters;
  a fake ``WANDB_API_KEY`` from the environment appears nowhere in the run dir; no W&B process left;
- ``kill -9`` after iteration 3 was logged and before iteration 4 logs anything (the checkpoint is
  at 2): a reward component of weight 0 (``hold_reward.py``) holds the run at iteration 4's first
  sample, and the test kills it there; then ``--resume``: the same tracker runs continue (ids kept in
  ``tracking.json``), steps 1..N once each in every tracker. No tracker can rewrite a step, so each
  keeps iteration 3 as first logged (W&B and Trackio write asynchronously: they may have lost it to
  the kill, and then hold the redone one): equal to ``metrics.jsonl`` (which holds the redone
  iteration 3) but for the wall-clock figures (the runs are deterministic: one thread).

And in process, fast, with TensorBoard: the session's bookkeeping across a simulated kill and resume
(steps a tracker holds are skipped, steps it lost are filled in from ``metrics.jsonl``), and a tracker
that fails to start is dropped with a warning while the run goes on. A kill between the writes of
one step: ``test_partial_steps.py``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from homerlhf.config import load_config

from tracker_readback import WALL_TIME, all_values, mlflow_sample_rows

N = 4
TRACKERS = ("tensorboard", "trackio", "wandb", "mlflow")
FAKE_KEY = "0123456789abcdef0123456789abcdeffakekey7"
HOLD = Path(__file__).with_name("hold_reward.py")


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_llama_dir):
    from homerlhf.tiny import build_sequence_classifier

    return tiny_llama_dir, build_sequence_classifier(tmp_path_factory.mktemp("rm"), arch="llama", seed=3)


def _train(models, out: Path, env: dict, *sets: str, **popen) -> subprocess.Popen:
    policy_dir, rm_dir = models
    overrides = [
        f"model.name_or_path={policy_dir}", "ref.backend=adapter_off", "reward.backend=hf", f"reward.model={rm_dir}",
        "rollout.batch_size=4", "rollout.chunk_size=4", "rollout.max_new_tokens=6", "ppo.mini_batch_size=2",
        "ppo.micro_batch_size=2", "ppo.epochs=1", "logging.progress=false", "logging.samples_per_iteration=2",
        "checkpoint.every=2", f"ppo.iterations={N}", "logging.report_to=tensorboard,trackio,wandb,mlflow", *sets,
    ]
    argv = ["train", "--preset", "cpu-tiny", "--out", str(out)] + [x for o in overrides for x in ("--set", o)]
    return subprocess.Popen([sys.executable, "-m", "homerlhf.cli", *argv], text=True, env=env,
                            **{"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **popen})


def _env(**extra) -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)


def _finish(proc: subprocess.Popen) -> str:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return out


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _numbers(row: dict) -> dict:
    return {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _check_against_jsonl(values: dict, rows: list[dict], *, exact_steps: set[int]) -> None:
    """Each metric at each step once, equal to the row's; wall-clock figures only at ``exact_steps``."""
    for row in rows:
        step = row["iteration"]
        for key, value in _numbers(row).items():
            logged = values[key][step]
            assert len(logged) == 1, (key, step, logged)
            if step in exact_steps or not key.startswith(WALL_TIME):
                assert logged[0] == value, (key, step, logged[0], value)
    steps = {step for series in values.values() for step in series}
    assert steps == {row["iteration"] for row in rows}


def _wandb_core_of(pid: int) -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline"])
            if "wandb-core" in " ".join(p.info["cmdline"] or []) and str(pid) in (p.info["cmdline"] or [])]


@pytest.fixture(scope="module")
def straight(models, tmp_path_factory):
    """A straight run, a fake W&B key in its environment (and WANDB_MODE=offline, as a user who set it)."""
    home = tmp_path_factory.mktemp("home")
    out = tmp_path_factory.mktemp("straight") / "run"
    env = _env(WANDB_API_KEY=FAKE_KEY, WANDB_MODE="offline", NETRC=str(home / "netrc"),
               WANDB_CONFIG_DIR=str(home / "wandb"), WANDB_CACHE_DIR=str(home / "cache"),
               WANDB_DATA_DIR=str(home / "data"), WANDB_SILENT="true")
    for name in ("MLFLOW_TRACKING_URI", "TRACKIO_DIR", "TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL", "WANDB_DIR"):
        env.pop(name, None)
    proc = _train(models, out, env)
    stdout = _finish(proc)
    return out, stdout, proc.pid


def test_every_metric_of_every_iteration_reaches_every_tracker(straight):
    out, stdout, _ = straight
    assert f"tensorboard: {out}/tensorboard" in stdout and f"mlflow: {(out / 'mlruns').as_uri()}" in stdout
    rows = _rows(out)
    assert [r["iteration"] for r in rows] == list(range(1, N + 1))
    values = all_values(out)
    for tracker in TRACKERS:
        metrics = {k: v for k, v in values[tracker].items() if not k.startswith(("samples", "config"))}
        _check_against_jsonl(metrics, rows, exact_steps=set(range(1, N + 1)))
    _check_sample_tables(values)


def _check_sample_tables(values: dict) -> None:
    """A table of the samples at each step, once (TensorBoard: a markdown table)."""
    for tracker, key in (("tensorboard", "samples/text_summary"), ("trackio", "samples"), ("wandb", "samples/nrows")):
        assert {step: len(v) for step, v in values[tracker][key].items()} == {s: 1 for s in range(1, N + 1)}, tracker


def test_the_run_config_is_each_trackers_parameters(straight, tmp_path, monkeypatch):
    import sqlite3

    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the run's file store, read back (as the tracker wrote it)

    out, _, _ = straight
    state = json.loads((out / "tracking.json").read_text())
    client = MlflowClient(tracking_uri=(out / "mlruns").as_uri())
    run = client.get_run(state["ids"]["mlflow"])
    assert run.data.params["ppo.iterations"] == str(N) and run.data.params["output_dir"] == str(out)
    assert run.data.params["run_name"] == state["run_name"] == run.info.run_name
    iterations = [row["iteration"] for row in mlflow_sample_rows(client.tracking_uri, run.info.run_id, tmp_path)]
    logged = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert sum(row["rank"] == "first" for row in logged) == 2 * N  # samples_per_iteration, and the best and worst
    assert sorted(iterations) == sorted(row["iteration"] for row in logged)  # every iteration's rows in MLflow
    with sqlite3.connect(out / "trackio" / "homerlhf.db") as con:
        (config,), = con.execute("SELECT config FROM configs").fetchall()
    assert json.loads(config)["reward.backend"] == "hf"
    from homerlhf.tracking.wandb_log import run_files

    assert b"ppo.iterations" in run_files(out / "wandb", state["ids"]["wandb"])[0].read_bytes()


def test_no_token_in_the_run_dir_and_no_wandb_process_left(straight):
    out, _, pid = straight
    leaked = [str(p) for p in out.rglob("*") if p.is_file() and FAKE_KEY.encode() in p.read_bytes()]
    assert leaked == []
    assert _wandb_core_of(pid) == []


def test_a_truncated_wandb_log_reads_up_to_its_last_whole_record(straight, tmp_path):
    from homerlhf.tracking.wandb_log import history, run_files

    out, _, _ = straight
    state = json.loads((out / "tracking.json").read_text())
    data = run_files(out / "wandb", state["ids"]["wandb"])[0].read_bytes()
    whole = history(run_files(out / "wandb", state["ids"]["wandb"])[0])
    cut = tmp_path / "run-cut.wandb"
    for size in (0, 7, 100, len(data) // 2, len(data) - 1):
        cut.write_bytes(data[:size])
        rows = history(cut)
        assert rows == whole[:len(rows)]


def _mlflow_steps(out: Path) -> int:
    files = list((out / "mlruns").glob("*/*/metrics/iteration"))
    return len(files[0].read_text().splitlines()) if files else 0


def _run_until_held(models, out: Path, tmp_path: Path) -> subprocess.Popen:
    """The run, held by ``hold_reward.py`` at iteration 4's first sample: iteration 3 is in every
    tracker (W&B's and Trackio's writes may still be on their way), iteration 4 not yet."""
    held, stderr = tmp_path / "held", tmp_path / "killed-run.stderr"
    component = f"reward.components=[{{backend: function, function: '{HOLD}:hold', weight: 0.0}}]"
    with stderr.open("w") as err:  # a file: a full pipe must not stall the run before the hold
        proc = _train(models, out, _env(HOMERLHF_TEST_HOLD_FILE=str(held)), component,
                      stdout=subprocess.DEVNULL, stderr=err)
    deadline = time.monotonic() + 600  # a guard against a hang only: the run stops itself at the hold
    while not held.exists():
        assert proc.poll() is None, f"the run ended ({proc.returncode}) before the hold: {stderr.read_text()[-3000:]}"
        assert time.monotonic() < deadline, "the run did not reach the hold in 600 s"
        time.sleep(0.1)
    assert [r["iteration"] for r in _rows(out)] == [1, 2, 3] and _mlflow_steps(out) == 3
    return proc


@pytest.mark.slow
def test_kill9_and_resume_log_each_step_once(models, tmp_path, offline_trackers):
    out = tmp_path / "run"
    proc = _run_until_held(models, out, tmp_path)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    ids = json.loads((out / "tracking.json").read_text())
    deadline = time.monotonic() + 30
    while _wandb_core_of(proc.pid) and time.monotonic() < deadline:  # it ends when its parent is gone
        time.sleep(0.2)
    assert _wandb_core_of(proc.pid) == []

    resumed = subprocess.Popen([sys.executable, "-m", "homerlhf.cli", "train", "--resume", str(out)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    _finish(resumed)
    assert json.loads((out / "tracking.json").read_text())["ids"] == ids["ids"]  # the same tracker runs
    rows = _rows(out)
    assert [r["iteration"] for r in rows] == list(range(1, N + 1))
    values = all_values(out)
    for tracker in TRACKERS:
        metrics = {k: v for k, v in values[tracker].items() if not k.startswith(("samples", "config"))}
        _check_against_jsonl(metrics, rows, exact_steps={1, 2, 4})  # 3: as logged before the kill
    _check_sample_tables(values)
    import sqlite3

    with sqlite3.connect(out / "trackio" / "homerlhf.db") as con:
        assert {name for (name,) in con.execute("SELECT DISTINCT run_name FROM metrics")} == {ids["run_name"]}


# -- the session's bookkeeping, in process, with TensorBoard (fast) ----------------------------------
def _row(step: int, value: float) -> dict:
    return {"iteration": step, "score_mean": value, "time_iteration_s": 0.5, "peak_mem_kind": "cpu_rss"}


@pytest.mark.parametrize("events_lost", [False, True])
def test_a_resumed_writer_fills_in_and_skips_so_each_step_is_logged_once(tmp_path, events_lost):
    """Steps 1..3 logged, the process gone without closing (as after kill -9), the logs cut back to a
    checkpoint at 2 (as --resume does), then 3..4 logged again (3 redone as 30.0): TensorBoard holds
    1..4 once each, step 3 as first logged; when the kill lost its events (deleted here, as W&B loses
    what it buffered), steps 1..2 are filled in from metrics.jsonl and 3 is the redone one."""
    from homerlhf.ppo.checkpoint import log_offsets
    from homerlhf.ppo.metrics import MetricsWriter
    from homerlhf.ppo.resuming import truncate_logs
    from tracker_readback import tensorboard_values

    cfg = load_config("cpu-tiny", overrides=["logging.report_to=tensorboard"])
    writer = MetricsWriter(tmp_path, cfg)
    for step in (1, 2):
        writer.log(_row(step, float(step)), [{"prompt": "p", "response": "r", "score": 0.0, "truncated": False}])
    offsets = log_offsets(tmp_path)  # the checkpoint at 2
    writer.log(_row(3, 3.0))
    writer.trackers.trackers[0].writer.close()  # what a kill leaves: the events on disk, nothing closed
    if events_lost:
        for events in (tmp_path / "tensorboard").glob("events.out.tfevents.*"):
            events.unlink()
    truncate_logs(tmp_path, offsets)

    resumed = MetricsWriter(tmp_path, cfg)
    for step, value in ((3, 30.0), (4, 4.0)):
        resumed.log(_row(step, value))
    resumed.close()
    values = tensorboard_values(tmp_path / "tensorboard")
    assert dict(values["score_mean"]) == {1: [1.0], 2: [2.0], 3: [30.0 if events_lost else 3.0], 4: [4.0]}
    assert "peak_mem_kind" not in values  # a string: metrics.jsonl only
    assert {step: len(v) for step, v in values["samples/text_summary"].items()} == {1: 1, 2: 1}


def test_a_tracker_that_fails_is_dropped_and_the_run_goes_on(tmp_path, caplog):
    from homerlhf.ppo.metrics import MetricsWriter, read_metrics

    (tmp_path / "tensorboard").write_text("a file where TensorBoard wants its directory")
    writer = MetricsWriter(tmp_path, load_config("cpu-tiny", overrides=["logging.report_to=tensorboard"]))
    writer.log(_row(1, 1.0))
    writer.log(_row(2, 2.0))
    writer.close()
    assert [r["iteration"] for r in read_metrics(tmp_path)] == [1, 2]
    assert "tensorboard did not start" in caplog.text
    assert json.loads((tmp_path / "tracking.json").read_text())["places"] == []

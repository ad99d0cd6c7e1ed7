"""The Train tab's monitor output for a run directory, and worker status against a live /health."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from homerlhf.app import runs, train_status, train_tab
from homerlhf.config import load_config, to_yaml


class _Health(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's naming
        authorised = self.headers.get("Authorization") == "Bearer s3cret"
        self.send_response(200 if authorised and self.path == "/health" else 401)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture()
def health_url():
    server = HTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


def test_poll_reads_progress_plot_and_samples(tmp_path):
    cfg = load_config("cpu-tiny", None, ["ppo.iterations=4", "ref.backend=adapter_off"])
    (tmp_path / "config.yaml").write_text(to_yaml(cfg))
    rows = [{"iteration": i, "score_mean": 0.1 * i, "time_iteration_s": 2.0} for i in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "samples.jsonl").write_text(json.dumps({"iteration": 2, "prompt": "<|user|>Hi<|end|>",
                                                        "response": "Hello", "score": 0.5}) + "\n")
    status, progress, figure, samples, workers, log, n_rows, state = train_tab.poll(str(tmp_path))
    assert "started outside the app" in status
    assert progress == "**Progress:** iteration 2/4 · 50% · elapsed 0m04s · ETA 0m04s"
    assert [list(trace.x) for trace in figure.data] == [[1, 2]] and n_rows == 2 and state == "unknown"
    assert samples == [[2, "Hi", "Hello", 0.5]]
    assert workers[0][:3] == ["ref", "adapter_off", "(in the trainer process)"]
    # Nothing new since the last poll: no figure to redraw.
    assert train_tab.poll(str(tmp_path), last_n=2)[2] is None


def test_worker_status_of_a_running_run(tmp_path, health_url, monkeypatch):
    monkeypatch.delenv("HOMERLHF_REWARD_TOKEN", raising=False)
    cfg = load_config("cpu-tiny", None, ["reward.token=s3cret"])
    (tmp_path / "config.yaml").write_text(to_yaml(cfg))  # the token is redacted there
    (tmp_path / "workers").mkdir()
    (tmp_path / "workers" / "reward.log").write_text(
        f"homerlhf worker ready role=reward port=1 url={health_url} pid=1\n")
    running = runs.RunStatus(tmp_path, "running", pid=1)
    assert train_tab.worker_table(tmp_path, running)[1][1:4] == ["llamacpp", health_url, "down (HTTP 401)"]
    monkeypatch.setenv("HOMERLHF_REWARD_TOKEN", "s3cret")  # a remote worker's token, given to the app
    assert train_tab.worker_table(tmp_path, running)[1][3] == "up"
    monkeypatch.delenv("HOMERLHF_REWARD_TOKEN")
    token_file = tmp_path / "workers" / "reward.log.token"  # the run's own worker: its 0600 token file
    token_file.write_text("s3cret")
    token_file.chmod(0o600)
    table = {row[0]: row for row in train_tab.worker_table(tmp_path, running)}
    assert table["reward"][1:4] == ["llamacpp", health_url, "up"]
    assert table["reward"][4] >= 0
    assert table["ref"][1:4] == ["llamacpp", "-", "starting"]  # no address announced yet
    stopped = runs.RunStatus(tmp_path, "finished")
    assert train_tab.worker_table(tmp_path, stopped)[1][3] == "run not running"


def test_the_status_says_where_the_run_is_tracked(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = load_config("cpu-tiny", None, ["logging.report_to=[tensorboard,mlflow]"])
    (tmp_path / "config.yaml").write_text(to_yaml(cfg))
    status = train_tab.poll(str(tmp_path))[0]  # not started yet: the places its config names
    assert (f"**Tracking:** tensorboard: {tmp_path}/tensorboard (view: tensorboard --logdir {tmp_path}/tensorboard); "
            f"mlflow: {(tmp_path / 'mlruns').as_uri()}") in status
    # Once its trackers started, the places they started with (tracking.json), whatever the app's environment.
    (tmp_path / "tracking.json").write_text(json.dumps({"places": ["mlflow: http://127.0.0.1:5000 (view: the web app)"]}))
    assert "**Tracking:** mlflow: http://127.0.0.1:5000 (view: the web app)" in train_tab.poll(str(tmp_path))[0]
    (tmp_path / "config.yaml").write_text(to_yaml(load_config("cpu-tiny", None, [])))
    (tmp_path / "tracking.json").unlink()
    assert "**Tracking:** metrics.jsonl only (logging.report_to: none)" in train_tab.poll(str(tmp_path))[0]


def test_a_stopped_run_shows_no_eta(tmp_path):
    cfg = load_config("cpu-tiny", None, ["ppo.iterations=4", "ref.backend=adapter_off"])
    (tmp_path / "config.yaml").write_text(to_yaml(cfg))
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"iteration": 1, "time_iteration_s": 2.0}) + "\n")
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "launch.json").write_text(json.dumps({"pid": 1, "argv": [], "started_at": 1000.0,
                                                              "stop_requested": 1010.0}))
    (tmp_path / "app" / "exit.json").write_text(json.dumps({"returncode": 130, "ended_at": 1012.0}))
    status, progress, *_, state = train_tab.poll(str(tmp_path))
    assert state == "stopped" and "stopped by you; it wrote no checkpoint, so there is nothing to resume" in status
    assert progress == "**Progress:** iteration 1/4 · 25% · elapsed 0m12s"  # ETA 0m06s before the Stop


def test_each_start_gets_a_fresh_default_directory(tmp_path, monkeypatch):
    monkeypatch.setattr(train_status.time, "strftime", lambda fmt: "app-20261201-120000")
    first = train_tab.default_run_dir(str(tmp_path))
    assert first == str(tmp_path / "app-20261201-120000")
    assert train_tab.is_default_run_dir(first, str(tmp_path))
    (tmp_path / first).mkdir()  # two Starts in the same second: the next one is -2
    second = train_tab.default_run_dir(str(tmp_path))
    assert second == first + "-2" and train_tab.is_default_run_dir(second, str(tmp_path))
    assert not train_tab.is_default_run_dir(str(tmp_path / "my-run"), str(tmp_path))


def test_a_poll_from_before_the_last_start_draws_nothing(tmp_path):
    """Issue 37 item 7: a poll sent before a Start (or still reading when it came) leaves the monitor the
    Start cleared; a poll sent after it draws. Two pages (sessions) count their Starts apart."""
    from types import SimpleNamespace

    (tmp_path / "metrics.jsonl").write_text(json.dumps({"iteration": 1, "score_mean": 0.5}) + "\n")
    page, other = SimpleNamespace(session_hash="page-a"), SimpleNamespace(session_hash="page-b")
    starts = train_tab.pause_monitor(page)[-1]
    stale = train_tab.refresh(str(tmp_path), -1, "running", starts - 1, page)
    assert all(getattr(out, "__class__", None) is dict and out.get("__type__") == "update" for out in stale[:6])
    fresh = train_tab.refresh(str(tmp_path), -1, "running", starts, page)
    assert fresh[2].data  # drawn: a figure with the row's line
    assert train_tab.refresh(str(tmp_path), -1, "running", 0, other)[2].data


def test_the_start_reply_writes_the_status_line_of_the_run_it_started(tmp_path):
    """The page applies each event's result as it comes, so a poll of the run before, sent just before
    Start cleared the monitor, can land after the clearing (seen once in CI under load: "Started" above the
    run before's "finished"). Start's reply, sent after both, carries the new run's status line."""
    from pathlib import Path

    root = tmp_path / "runs"
    before = root / "app-20261201-120000"
    before.mkdir(parents=True)
    (before / "metrics.jsonl").write_text(json.dumps({"iteration": 1, "score_mean": 0.5}) + "\n")
    reply = train_tab.on_start("cpu-tiny", "builtin:tiny-llama", "ref.backend=adapter_off\nreward.backend=function\n"
                               "reward.function=builtin:reverse", "builtin:demo-sft", str(before), False, str(root))
    message, attached, shared, box, n_rows, state, status = reply
    try:
        assert message.startswith("Started") and attached == shared == box != str(before)
        assert (n_rows, state) == (-1, "running")
        assert status.startswith(f"**Run:** `{attached}` — running") and str(before) not in status
    finally:
        runs.stop_run(Path(attached), force=True)
        runs.wait_for(Path(attached), 30)


def test_every_event_that_draws_the_monitor_runs_one_at_a_time_in_the_queue():
    """The count check above holds only if a poll's result cannot overtake a Start's: a handler sends its
    result when it is done, so a poll that checked just before a Start (or a Start answered outside the
    queue) could draw the run before over the cleared monitor. Every event writing the status (polls,
    Start's clearing and its reply, Resume, Attach, the run the other tabs moved to, the page's re-attach)
    is queued in one group of one."""
    from homerlhf.app.ui import build_app

    blocks = build_app()
    drawing = [fn for fn in blocks.fns.values() if any(getattr(o, "elem_id", None) == "train-status" for o in fn.outputs)]
    kinds = {target[1] for fn in drawing for target in fn.targets}
    assert {"tick", "click", "change", "then"} <= kinds and len(drawing) >= 8
    for fn in drawing:
        assert fn.queue and fn.concurrency_id == "train-monitor" and fn.concurrency_limit == 1, (fn.name, fn.targets)


def test_an_attach_draws_the_run_whatever_a_poll_from_before_it_left(tmp_path):
    """A poll sent before an Attach (the timer's, for the run attached before) draws nothing over it, and
    the Attach's own draw does not depend on the rows count such a poll left in the page's state (seen
    in the browser under load: the attached run's plot never came)."""
    from types import SimpleNamespace

    (tmp_path / "metrics.jsonl").write_text(json.dumps({"iteration": 1, "kl_mean": -0.018}) + "\n")
    page = SimpleNamespace(session_hash="page-attach")
    before = train_tab._starts_pressed(page)
    after = train_tab.new_watch(page)
    assert after == before + 1
    stale = train_tab.refresh(str(tmp_path), -1, "finished", before, page)
    assert all(out == {"__type__": "update"} for out in stale[:6])
    assert train_tab.refresh(str(tmp_path), 1, "finished", after, page)[2] == {"__type__": "update"}  # "drawn"
    drawn = train_tab.redraw(str(tmp_path), 1, "finished", after, page)  # 1: what the stale poll left
    assert drawn[2].data and drawn[6] == 1


def test_the_monitor_follows_the_run_the_other_tabs_moved_to(tmp_path):
    """A feedback run started in Evaluate moves the shared run dir: the monitor attaches to it (redraws)."""
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 0.69}) + "\n")
    attached, box, status, *_, n_rows, state, message = train_tab.follow_shared(str(tmp_path), "")
    assert (attached, box, n_rows, state, message) == (str(tmp_path), str(tmp_path), 1, "unknown",
                                                       f"Attached to `{tmp_path}`.")
    assert str(tmp_path) in status
    assert train_tab.follow_shared(str(tmp_path), str(tmp_path)) == ({"__type__": "update"},) * 11  # already attached


def test_a_feedback_run_attached_names_its_own_metrics_and_what_start_would_start(tmp_path):
    """While a DPO / KTO run is attached, *Metric names* lists its figures (not PPO's), and the command's label says
    that *Start training* starts a new PPO run beside it."""
    from homerlhf.app import feedback_runs

    run = tmp_path / "dpo-1"
    (run / feedback_runs.FOLDER).mkdir(parents=True)
    (run / feedback_runs.FOLDER / feedback_runs.INFO_FILE).write_text(json.dumps({"method": "dpo", "start_checkpoint": "c"}))
    caption, command = train_tab.describe_attached(str(run))
    assert "Reward margin (chosen - rejected)" in caption and "`rewards/margins`" in caption and "kl_coef" not in caption
    assert command["label"].endswith("a new PPO run of the Plan tab's settings (the run attached is a DPO run)")
    caption, command = train_tab.describe_attached(str(tmp_path))  # any other run: PPO's names
    assert "`kl_coef`" in caption and command["label"] == train_tab.COMMAND_LABEL


def test_attach_takes_a_directory_typed_in_the_run_directory_box(tmp_path):
    """*Attach* attaches what *Existing runs* names, or — while that still names the attached run — a run typed in
    the *Run directory* box (it was ignored); a typed path that holds no run is not taken."""
    first, typed = tmp_path / "first", tmp_path / "typed"
    for run in (first, typed):
        run.mkdir()
        (run / "metrics.jsonl").write_text(json.dumps({"iteration": 1}) + "\n")
    assert train_tab.attach_choice(str(first), str(typed), str(first)) == str(typed)
    assert train_tab.attach_choice(str(typed), str(first), str(first)) == str(typed)  # a new pick wins
    assert train_tab.attach_choice(str(first), str(tmp_path / "nothing"), str(first)) == str(first)
    message, attached, *_ = train_tab.on_attach(str(first), str(typed), str(first))
    assert (message, attached) == (f"Attached to `{typed}`.", str(typed))


def test_start_on_a_gpu_preset_without_prompts_says_where_to_give_them(tmp_path):
    """The GPU presets carry no prompts: Start names the Data tab (the CLI names --data), with every other
    problem found on the same line, and starts nothing."""
    import torch

    from homerlhf.errors import UserError

    root = tmp_path / "runs"
    with pytest.raises(UserError) as caught:
        train_tab.on_start("4090", "Qwen/Qwen2.5-0.5B", "", "Qwen/Qwen2.5-7B-Instruct", "", False, str(root))
    message = str(caught.value)
    assert message.startswith(train_tab.NO_PROMPTS_HERE) and "--data" not in message
    assert ("needs a CUDA GPU" in message) == (not torch.cuda.is_available())
    assert not root.exists()


def test_the_reply_to_force_stop_stays_when_the_run_has_ended(tmp_path):
    """The poll takes the Start line away when a run ends; the reply to Stop or Force stop (state
    ``STOPPING``) stays, also once the run has ended. A poll from before the press draws nothing, its
    state included (it still thinks the run is running)."""
    from types import SimpleNamespace

    page = SimpleNamespace(session_hash="page-stop")
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"iteration": 1, "score_mean": 0.5}) + "\n")
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "launch.json").write_text(json.dumps({"pid": 1, "argv": [], "started_at": 1000.0,
                                                              "stop_requested": 1010.0}))
    (tmp_path / "app" / "exit.json").write_text(json.dumps({"returncode": -9, "ended_at": 1011.0}))
    before = train_tab.new_watch(page)
    message, state, starts = train_tab.kill_pressed(str(tmp_path), page)
    assert state == train_tab.STOPPING and starts == before + 1 and "nothing to stop" in message  # it has ended
    stale = train_tab.refresh(str(tmp_path), 1, "running", before, page)
    assert all(out.get("__type__") == "update" and "value" not in out for out in stale)
    *_, state, kept = train_tab.refresh(str(tmp_path), -1, train_tab.STOPPING, starts, page)
    assert state == "stopped" and kept.get("__type__") == "update" and "value" not in kept
    *_, cleared = train_tab.refresh(str(tmp_path), -1, "running", starts, page)  # ended without a Stop here
    assert cleared == ""

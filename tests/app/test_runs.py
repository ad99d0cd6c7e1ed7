"""Runs as detached processes: start, exit codes, graceful stop, attach after an app restart."""

from __future__ import annotations

import os
import sys
import textwrap
import time

import pytest

from homerlhf.app import runs

# A stand-in trainer process for the process mechanics only (the real `homerlhf train` is driven
# by the browser test): it logs a metrics row per tick and, on SIGINT, writes a checkpoint marker
# and exits 0, which is what issue 8 asks of the trainer.
FAKE_TRAINER = textwrap.dedent(
    """
    import json, signal, sys, time
    from pathlib import Path
    run = Path(sys.argv[1])
    stop = []
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    for i in range(1, 600):
        with open(run / "metrics.jsonl", "a") as fh:
            fh.write(json.dumps({"iteration": i, "score_mean": i / 10}) + "\\n")
        if stop:
            (run / "checkpoint-on-stop").write_text(str(i))
            sys.exit(0)
        time.sleep(0.05)
    """
)


@pytest.fixture()
def fake_program(tmp_path):
    script = tmp_path / "fake_trainer.py"
    script.write_text(FAKE_TRAINER)
    return [sys.executable, str(script)]


def test_train_argv_and_command():
    argv = runs.train_argv("cpu-tiny", "runs/x y", None, ["ppo.iterations=2", "data.prompts=my file.jsonl"])
    assert argv == ["train", "--preset", "cpu-tiny", "--set", "ppo.iterations=2", "--set",
                    "data.prompts=my file.jsonl", "--out", "runs/x y"]
    assert runs.format_command(argv) == (
        "homerlhf train --preset cpu-tiny --set ppo.iterations=2 --set 'data.prompts=my file.jsonl' --out 'runs/x y'"
    )


def test_crashed_run_reports_the_cli_error(tmp_path):
    run_dir = tmp_path / "bad"
    runs.start_run(run_dir, runs.train_argv("no-such-preset", run_dir))
    status = runs.wait_for(run_dir, timeout=60)
    assert status.state == "crashed"
    assert status.returncode == 2
    assert "unknown preset 'no-such-preset'" in status.message()
    assert "Traceback" not in status.log_tail


def test_detached_run_stops_gracefully_and_is_seen_after_restart(tmp_path, fake_program):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    status = runs.start_run(run_dir, [str(run_dir)], program=fake_program)
    assert status.running
    # Its own session: a Ctrl-C in the app's terminal or the app exiting does not reach it.
    assert os.getsid(status.pid) != os.getsid(0)
    deadline = time.monotonic() + 30
    while not (run_dir / "metrics.jsonl").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(Exception, match="already going"):
        runs.start_run(run_dir, [str(run_dir)], program=fake_program)

    runs._CHILDREN.clear()  # the app restarted: it knows the run from its files only
    assert runs.run_status(run_dir).running
    assert "asked the run to stop" in runs.stop_run(run_dir)
    status = runs.wait_for(run_dir, timeout=30)
    assert status.state == "stopped", status
    assert status.returncode == 0
    assert (run_dir / "checkpoint-on-stop").exists()
    assert "nothing to stop" in runs.stop_run(run_dir)


def test_force_stop_kills_a_run_that_ignores_sigint(tmp_path):
    script = tmp_path / "stubborn.py"
    ready = tmp_path / "ignoring-sigint"  # written once the handler is in place: a SIGINT before it would kill it
    script.write_text("import pathlib, signal, sys, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
                      "pathlib.Path(sys.argv[1]).touch()\ntime.sleep(60)\n")
    run_dir = tmp_path / "stubborn"
    runs.start_run(run_dir, [], program=[sys.executable, str(script), str(ready)])
    deadline = time.monotonic() + 60
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ready.exists()
    runs.stop_run(run_dir)
    assert runs.wait_for(run_dir, timeout=1.5).running
    assert "killed at once" in runs.stop_run(run_dir, force=True)
    status = runs.wait_for(run_dir, timeout=10)
    # Killed (no exit code recorded by the launcher), as asked: stopped by you, not a crash, and where to go on.
    assert status.state == "stopped" and status.forced
    assert status.message() == ("stopped by you with Force stop (no checkpoint at the stop); it wrote no checkpoint, "
                                "so there is nothing to resume: Start a new run")
    (run_dir / "checkpoints" / "iter_000002").mkdir(parents=True)
    assert runs.run_status(run_dir).message().endswith(
        f"; its last checkpoint is {run_dir / 'checkpoints' / 'iter_000002'}: Resume continues from it")


def test_list_runs_and_checkpoints(tmp_path):
    (tmp_path / "a" / "checkpoints" / "iter_000002").mkdir(parents=True)
    (tmp_path / "a" / "checkpoints" / "iter_000010").mkdir(parents=True)
    (tmp_path / "a" / "checkpoints" / ".tmp-iter_000011").mkdir(parents=True)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "metrics.jsonl").write_text("")
    (tmp_path / "not-a-run").mkdir()
    assert {p.name for p in runs.list_runs(tmp_path)} == {"a", "b"}
    assert [p.name for p in runs.list_checkpoints(tmp_path / "a")] == ["iter_000010", "iter_000002"]
    assert runs.run_status(tmp_path / "b").state == "unknown"
    assert runs.run_status(tmp_path / "not-a-run").state == "not started"


def test_worker_urls_from_config_and_worker_log(tmp_path):
    from homerlhf.config import load_config, to_yaml

    cfg = load_config("cpu-tiny", None, ["ref.backend=adapter_off"])
    (tmp_path / "config.yaml").write_text(to_yaml(cfg))
    (tmp_path / "workers").mkdir()
    (tmp_path / "workers" / "reward.log").write_text(
        "loading\nhomerlhf worker ready role=reward port=1234 url=http://127.0.0.1:1234 pid=1\n"
        "restarted\nhomerlhf worker ready role=reward port=1240 url=http://127.0.0.1:1240 pid=2\n"
    )
    assert runs.worker_urls(tmp_path) == {"ref": "", "reward": "http://127.0.0.1:1240"}
    assert runs.run_config(tmp_path) == cfg


def test_last_error_line():
    log = "loading\nTraceback (most recent call last):\n  File x\nValueError: bad thing\n"
    assert runs.last_error_line(log) == "ValueError: bad thing"
    assert runs.last_error_line("x\nerror: unknown preset 'p'\n") == "error: unknown preset 'p'"


def test_a_launcher_that_ended_is_reaped_without_anyone_polling_it(tmp_path):
    import psutil

    run_dir = tmp_path / "quick"
    status = runs.start_run(run_dir, [], program=[sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while runs.run_status(run_dir).running and time.monotonic() < deadline:  # reads files only
        time.sleep(0.05)
    assert runs.run_status(run_dir).state == "finished"

    def state() -> str:
        try:
            return psutil.Process(status.pid).status()
        except psutil.NoSuchProcess:
            return "gone"

    # exit.json is written just before the launcher exits: wait for the exit itself, then for the reaping.
    deadline = time.monotonic() + 10
    while state() != "gone" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert state() == "gone", f"launcher {status.pid} is {state()}: a <defunct> child of the app"
    assert status.pid not in [c.pid for c in psutil.Process().children()]

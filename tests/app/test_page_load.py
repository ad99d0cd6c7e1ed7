"""What a page load brings back (homerlhf.app.page_load), on runs the launcher really started: a running
run's Plan settings read back from its launch record, and the newest run attached when none runs (the
browser: tests/app/test_browser_dead_ends.py)."""

from __future__ import annotations

import sys

from homerlhf.app import page_load, runs, train_tab

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]  # a launched process that stays up until stopped


def test_a_running_runs_settings_come_back_and_a_finished_run_is_attached(tmp_path):
    root = tmp_path / "runs"
    first, second = root / "app-20261202-100000", root / "app-20261202-100500"
    runs.start_run(first, [], program=[sys.executable, "-c", "pass"])
    assert not runs.wait_for(first, 20).running
    items = ["model.name_or_path=builtin:tiny-llama", "reward.backend=function", "reward.function=builtin:reverse",
             "reward.components=[{backend: function, function: 'builtin:reverse-positions', weight: 0.5}, "
             "{backend: llamacpp, model: 'builtin:demo-rm', weight: 0.2}]", "algorithm=grpo", "group.size=4"]
    runs.start_run(second, runs.train_argv("cpu-tiny", second, None, items), program=SLEEPER)
    try:
        assert page_load.running_run(str(root)) == str(second)
        preset, model, overrides, preset_model, shown, algorithm, function, components, typed, gpu = \
            page_load.restore_settings(str(root))
        assert gpu == {"__type__": "update"}  # a launch record has no GPU GiB to plan for: the box is left
        assert (preset, model, shown, algorithm) == ("cpu-tiny", "builtin:tiny-llama", "cpu-tiny", "grpo")
        assert overrides.splitlines() == items and preset_model == "builtin:demo-sft"
        assert (function, components) == ("builtin:reverse", "0.5 builtin:reverse-positions\n0.2 rm:builtin:demo-rm")
        assert typed == {"cpu-tiny": "builtin:tiny-llama"}
        # What Start runs, drawn from the restored boxes, is the command the run was launched with.
        command = train_tab.show_command(preset, model, overrides, preset_model, str(second), False)
        assert command == runs.format_command(runs.run_status(second).argv, multiline=True)
        # The re-attach line says where the settings went.
        loaded = page_load.attach_on_load(train_tab.on_page_load(str(root)), str(root))
        assert loaded[1] == str(second) and loaded[-1] == (f"Re-attached to the running run `{second}`. Its preset, "
                                                           "model and overrides are back in the Plan tab.")
    finally:
        runs.stop_run(second, force=True)
    assert not runs.wait_for(second, 20).running
    # Nothing runs: the Plan boxes are left as they are, and the newest run (by its directory's time) is attached.
    assert all(not isinstance(v, str) for v in page_load.restore_settings(str(root)))
    newest = str(second)  # started last: its directory is the newest
    reattached = train_tab.on_page_load(str(root))
    assert reattached[1] == ""  # the Train tab alone attaches nothing after a run
    loaded = page_load.attach_on_load(reattached, str(root))
    assert loaded[1] == loaded[2] == newest and loaded[3] == reattached[3] != newest  # Start: a fresh directory
    assert loaded[-1].startswith(f"Attached to the latest run `{newest}` (")


def test_a_run_started_from_a_shell_has_no_settings_to_restore(tmp_path):
    shell = tmp_path / "shell-run"
    shell.mkdir()
    (shell / "metrics.jsonl").write_text('{"iteration": 1}\n')
    assert page_load.launched_items(str(shell)) is None and page_load.settings_of(str(shell)) is None
    assert page_load.reward_boxes(["reward.backend=hf", "reward.components=[oops"]) == ("", "")


def test_the_settings_the_page_left_come_back_before_a_running_runs(tmp_path):
    """The page's settings (page_settings: written on every change) come back on a reload with no run, and win
    over a running run's launch record; the re-attach line then says the Plan tab keeps them."""
    from homerlhf.app import page_settings

    root = tmp_path / "runs"
    names = [*page_load.PLAN_NAMES, "data_mode", "data_max_rows"]
    page_settings.save(root, names, ("cpu-tiny", "builtin:tiny-llama", "data.prompts=my.jsonl\nppo.iterations=4", "ppo",
                                     "", "", {"cpu-tiny": "builtin:tiny-llama"}, 0, "upload", 50))
    restored = page_load.restore_settings(str(root), ("data_mode", "data_max_rows", "data_split"))
    assert restored[:10] == ("cpu-tiny", "builtin:tiny-llama", "data.prompts=my.jsonl\nppo.iterations=4", "builtin:demo-sft",
                             "cpu-tiny", "ppo", "", "", {"cpu-tiny": "builtin:tiny-llama"}, 0)
    assert restored[10:] == ("upload", 50, {"__type__": "update"})  # a box never saved is left as it is
    run = root / "app-20261202-100000"
    runs.start_run(run, runs.train_argv("cpu-tiny", run, None, ["ppo.iterations=2"]), program=SLEEPER)
    try:
        assert page_load.restore_settings(str(root))[2] == "data.prompts=my.jsonl\nppo.iterations=4"  # the page's
        loaded = page_load.attach_on_load(train_tab.on_page_load(str(root)), str(root))
        assert loaded[-1] == f"Re-attached to the running run `{run}`. {page_load.KEPT}"
    finally:
        runs.stop_run(run, force=True)
    assert not runs.wait_for(run, 20).running
    (root / page_settings.FILE).write_text("[not an object")
    assert page_settings.load(root) == {} and page_load.saved_settings(str(root)) is None

"""Issue 62 in Chromium: the page's settings survive a reload and Start runs them, the run length is a Train
tab field, a bad field is one line naming it, Force stop says "stopped by you" and where the last checkpoint is
and Resume continues from it, and the first screen says where to start and what is active.

One walk on the cheap cpu-tiny setup (browser_kit): the first screen; bad fields (Max rows, GPU GiB, Iterations);
an upload used for training and the run length typed in the Train tab; a reload with no run (the settings come
back); Start (its command has them); Force stop after the first checkpoint; Resume to the end. Screenshots go to
``test-artifacts/app/``.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from browser_kit import (
    ARTIFACTS, BROWSER_MARKS, cheap_overrides, fill, open_tab, value_of, wait_page_loaded, wait_text, wait_value,
)

pytestmark = BROWSER_MARKS

ITERATIONS = 4


def first_screen_says_where_to_start(page) -> None:
    """Item 8: where to start, and what Start would train (preset, data, length) before anything is touched."""
    page.evaluate("window.scrollTo(0, 0)")
    assert "Start here." in page.locator("#app-start-here").inner_text()
    active = page.locator("#app-active").inner_text()
    assert re.search(r"preset cpu-tiny \(CPU only\) · model builtin:demo-sft · data builtin:demo \(the preset's\) · "
                     r"PPO, 12 iterations · overrides: none", active), active
    assert "none found here" in page.locator("#app-heading").inner_text()  # no GPU on this machine: said so
    page.screenshot(path=str(ARTIFACTS / "8a-first-screen.png"))


def bad_fields_are_one_line_naming_them(page, tmp_path: Path) -> None:
    """Item 6: a bad field is named with its fix, in one line (it was a raw ValidationError, or read silently)."""
    open_tab(page, "Data")
    fill(page, "data-max-rows", "-5")
    page.locator("#data-load").click()
    error = wait_text(page, "data-message", r"Error: ")
    assert error.strip() == "Error: 'Max rows' is -5: give 0 (all rows) or a whole number of rows to keep, e.g. 500"
    fill(page, "data-max-rows", "0")
    page.locator("#data-mode").get_by_label("hub id", exact=True).check()  # another source: the old error goes
    page.wait_for_function("() => !document.querySelector('#data-message')?.innerText.trim()")
    page.locator("#data-mode").get_by_label("builtin", exact=True).check()
    open_tab(page, "Plan")
    fill(page, "plan-gpu-gib", "-7")
    page.locator("#plan-run").click()
    error = wait_text(page, "plan-message", r"Error: ")
    assert error.strip() == ("Error: 'Plan for GPU GiB' is -7: give 0 (plan for the preset's card) or your card's "
                             "memory in GiB, e.g. 24")
    fill(page, "plan-gpu-gib", "0")
    fill(page, "plan-yaml-path", str(tmp_path / "run.yaml"))
    page.locator("#plan-save").click()  # its confirmation under its button, not two screens above
    wait_text(page, "plan-save-message", r"^Saved " + re.escape(str(tmp_path / "run.yaml")))
    open_tab(page, "Train")
    fill(page, "train-iterations", "-3")
    error = wait_text(page, "train-message", r"Error: ")
    assert error.strip() == "Error: 'Iterations' is -3: give a whole number of iterations, 1 or more (e.g. 20)"


def set_data_overrides_and_length(page, reward_dir: Path, tmp_path: Path) -> tuple[str, list[str]]:
    """An upload used for training, the cheap overrides typed in Plan, the length typed in Train."""
    prompts = tmp_path / "my-prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Say something about {w}."}) + "\n"
                               for w in ("tea", "cats", "rain", "maps", "owls", "snow", "bread", "ships")))
    typed = [line for line in cheap_overrides(reward_dir).splitlines() if not line.startswith("ppo.iterations")]
    open_tab(page, "Plan")
    fill(page, "plan-overrides", "\n".join(typed))
    open_tab(page, "Data")
    page.locator("#data-mode").get_by_label("upload", exact=True).check()
    page.locator("#data-upload input[type=file]").set_input_files(str(prompts))
    page.locator("#data-use").click()
    used = wait_text(page, "data-message", r"Set data\.prompts=\S+ in the Plan tab's overrides")
    kept = re.search(r"data\.prompts=(\S+)", used).group(1)
    assert Path(kept).name == prompts.name and Path(kept).read_text() == prompts.read_text()  # kept by the app
    open_tab(page, "Train")
    fill(page, "train-iterations", str(ITERATIONS))
    wait_text(page, "train-command", re.escape(f"--set ppo.iterations={ITERATIONS}"))
    wait_text(page, "app-active", re.escape(f"data {kept} · PPO, {ITERATIONS} iterations"))
    page.screenshot(path=str(ARTIFACTS / "8b-train-length.png"), full_page=True)
    return kept, [*typed, f"data.prompts={kept}", f"ppo.iterations={ITERATIONS}"]


def a_reload_with_no_run_brings_them_back(page, kept: str, overrides: list[str]) -> None:
    """Item 1: after a reload (no run running) the page shows the settings it left, in every tab."""
    page.reload()
    wait_page_loaded(page)
    open_tab(page, "Plan")
    wait_value(page, "plan-overrides", "\n".join(overrides))
    open_tab(page, "Train")
    wait_value(page, "train-iterations", str(ITERATIONS))
    command = wait_text(page, "train-command", re.escape(f"--set data.prompts={kept}"))
    assert re.findall(r"--set (\S+)", command) == overrides
    open_tab(page, "Data")
    assert page.locator("#data-mode input:checked").first.evaluate("e => e.value") == "upload"
    shown = page.locator("#data-upload").inner_text()  # the upload is back, not builtin:demo (its name, then its size)
    assert re.search(r"my-prompts\s*\.jsonl", shown), shown
    assert re.search(re.escape(f"data {kept} · PPO, {ITERATIONS} iterations"), page.locator("#app-active").inner_text())
    page.screenshot(path=str(ARTIFACTS / "8c-data-after-reload.png"), full_page=True)


def start_runs_what_the_page_shows(page, overrides: list[str]) -> Path:
    open_tab(page, "Train")
    page.locator("#train-start").click()
    wait_text(page, "train-message", r"Started: running \(pid \d+\)")
    run_dir = Path(value_of(page, "train-run-dir"))
    argv = json.loads((run_dir / "app" / "launch.json").read_text())["argv"]
    assert [argv[i + 1] for i, word in enumerate(argv) if word == "--set"] == overrides
    return run_dir


def force_stop_says_stopped_by_you_and_resume_goes_on(page, run_dir: Path) -> None:
    """Item 4: Force stop after a checkpoint reads "stopped by you" with where the last checkpoint is (it read as a
    crash); Resume continues from it to the end."""
    deadline = time.monotonic() + 180
    while not list((run_dir / "checkpoints").glob("iter_*")) and time.monotonic() < deadline:
        time.sleep(0.25)
    assert list((run_dir / "checkpoints").glob("iter_*")), (run_dir / "app" / "train.log").read_text()[-2000:]
    page.locator("#train-kill").click()
    wait_text(page, "train-message", r"Force stop: the run was killed at once, without a checkpoint at the stop")
    status = wait_text(page, "train-status", r"stopped by you", timeout_s=30)
    last = re.search(r"its last checkpoint is (\S+): Resume continues from it", status)
    assert last and "crashed" not in status and "Fix the setting" not in status, status
    assert "with Force stop (no checkpoint at the stop)" in status
    newest = sorted(p.name for p in (run_dir / "checkpoints").glob("iter_*"))[-1]
    assert Path(last.group(1)) == run_dir / "checkpoints" / newest
    page.screenshot(path=str(ARTIFACTS / "8d-force-stopped.png"), full_page=True)
    page.locator("#train-resume").click()
    wait_text(page, "train-message", rf"Resumed {re.escape(str(run_dir))} from {newest}: running \(pid \d+\)")
    status = wait_text(page, "train-status", r"— (finished|crashed|stopped)", timeout_s=240)
    assert "finished" in status, (run_dir / "app" / "train.log").read_text()[-2000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["iteration"] == ITERATIONS
    wait_text(page, "train-progress", rf"iteration {ITERATIONS}/{ITERATIONS}")
    page.get_by_text("Training log (tail)").click()
    shown = page.locator("#train-log textarea").input_value()
    assert "Resumed" not in shown and "iteration" in shown  # the trainer's own lines ...
    assert not re.search(r"Warning: |^\s*warnings\.warn|^llama_\w*: ", shown, re.M), shown  # ... no library noise


def test_settings_survive_a_reload_and_runs_stop_and_resume(page, app_url, reward_dir, tmp_path, capfd):
    first_screen_says_where_to_start(page)
    bad_fields_are_one_line_naming_them(page, tmp_path)
    kept, overrides = set_data_overrides_and_length(page, reward_dir, tmp_path)
    a_reload_with_no_run_brings_them_back(page, kept, overrides)
    run_dir = start_runs_what_the_page_shows(page, overrides)
    force_stop_says_stopped_by_you_and_resume_goes_on(page, run_dir)
    out, err = capfd.readouterr()
    log = out + err
    at = log.find("Traceback")
    assert at < 0 and "ValidationError" not in log, log[at:at + 4000]  # none in the app's log either

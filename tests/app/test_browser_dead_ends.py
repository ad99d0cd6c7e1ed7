"""Issue 44, item 4: the app's dead ends a user's walk found, each a browser assertion (Debian's Chromium,
headless, driven by Playwright; the second Start and Evaluate's are tests/app/test_browser_feedback.py's).

One short run (the cheap cpu-tiny setup of browser_kit, one iteration) serves the reload and Export and
monitor checks; the Plan and Data checks run while it trains. Each assertion marked "(a)" ... "(e)" failed
on the app before the fix (checked by reverting each fix). Screenshots go to ``test-artifacts/app/``.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

from browser_kit import ARTIFACTS, BROWSER_MARKS, cheap_overrides, choose, fill, open_tab, plot_texts, value_of, wait_text

pytestmark = BROWSER_MARKS


def start_reload_and_see_its_settings(page, runs_root: Path, reward_dir: Path) -> Path:
    """(b) A reload during a run brings back the Plan settings it was started with (it emptied them)."""
    overrides = cheap_overrides(reward_dir)
    open_tab(page, "Plan")
    fill(page, "plan-overrides", overrides)
    model = value_of(page, "plan-model")
    open_tab(page, "Train")
    wait_text(page, "train-command", re.escape("rollout.max_new_tokens=6"))
    page.locator("#train-start").click()
    wait_text(page, "train-message", r"Started: running \(pid \d+\)")
    run_dir = Path(value_of(page, "train-run-dir"))
    page.reload()
    open_tab(page, "Train")
    wait_text(page, "train-message", r"Re-attached to the running run .* Its preset, model and overrides are back "
                                     r"in the Plan tab\.", timeout_s=20)
    argv = json.loads((run_dir / "app" / "launch.json").read_text())["argv"]
    command = wait_text(page, "train-command", re.escape(f"--out {run_dir}"))  # the running run's directory
    shown = re.findall(r"--set (\S+)", command)
    assert shown == [argv[i + 1] for i, word in enumerate(argv) if word == "--set"] == overrides.splitlines()
    open_tab(page, "Plan")
    assert value_of(page, "plan-overrides").splitlines() == overrides.splitlines()
    assert value_of(page, "plan-model") == model  # the page as it was left (the overrides name the run's model)
    return run_dir


def apply_takes_the_recommended_placement(page) -> None:
    """(a) Where the time section recommends overrides, Apply adds them (it said "the plan fits")."""
    open_tab(page, "Plan")
    fill(page, "plan-overrides", "rollout.engine=hf")
    page.locator("#plan-run").click()
    # The preset's placement with HF generate named (the plan of the restored overrides is gone from the page).
    time_text = wait_text(page, "plan-time", r"^Time per iteration \(ref llamacpp, reward llamacpp, rollout hf\)")
    recommended = re.search(r"recommended: add (.*?) to the overrides", time_text)
    assert recommended, time_text  # by the default rates the llama.cpp engine samples faster here (issue 46)
    items = recommended.group(1).split()
    assert "rollout.engine=llamacpp" in items
    page.locator("#plan-apply").click()
    wait_text(page, "plan-message", r"^Applied: " + re.escape(" ".join(items)) + r" \(the recommended placement\)")
    applied = value_of(page, "plan-overrides").splitlines()
    assert set(items) <= set(applied) and "rollout.engine=hf" not in applied  # the named engine replaced
    wait_text(page, "plan-time", r"is the fastest that fits")


def a_plan_that_fits_nowhere_says_so(page) -> None:
    """(a) Qwen2.5-14B on the 3060: no "the fastest that fits" under "does NOT fit", and Apply says why it
    has nothing to apply (it said "the plan fits, or run Plan first")."""
    open_tab(page, "Plan")
    choose(page, "plan-preset", "3060-12g")
    wait_text(page, "plan-verdict", r"RTX 3060 12GB")
    fill(page, "plan-model", "Qwen/Qwen2.5-14B")
    page.locator("#plan-run").click()
    wait_text(page, "plan-verdict", r"does NOT fit RTX 3060 12GB")
    time_text = wait_text(page, "plan-time", r"no placement fits the 90% budget \(10\.8 of 12 GiB\)")
    assert "fastest that fits" not in time_text
    page.locator("#plan-apply").click()
    wait_text(page, "plan-message", r"Error: no suggestion to apply: no setting in the search fits with 10% of the card")
    page.screenshot(path=str(ARTIFACTS / "6a-plan-no-fit.png"), full_page=True)


def a_failed_load_clears_the_last_ones_results(page) -> None:
    """(c) A load that fails leaves none of the previous load's results under its error."""
    open_tab(page, "Data")
    page.locator("#data-load").click()
    wait_text(page, "data-report", r"usable:\s*120")
    page.locator("#data-mode").get_by_label("hub id", exact=True).check()
    fill(page, "data-hub", "acme/not-a-dataset")
    page.locator("#data-load").click()
    wait_text(page, "data-message", r"Error: cannot load dataset 'acme/not-a-dataset'")
    assert page.locator("#data-report").inner_text().strip() == ""
    assert "user:" not in page.locator("#data-samples").inner_text()


def data_tab_names_its_fields_and_lines(page, tmp_path: Path) -> None:
    """(c) The error names the tab's own field (not data.prompt_column), and bad rows are placed by the
    file's line counted from 1."""
    path = tmp_path / "asks.jsonl"
    path.write_text("\n".join([json.dumps({"text": "Say hi."}), "{not json", json.dumps({"text": "Say bye."})]) + "\n")
    open_tab(page, "Data")
    page.locator("#data-mode").get_by_label("upload", exact=True).check()
    page.locator("#data-upload input[type=file]").set_input_files(str(path))
    page.locator("#data-load").click()
    error = wait_text(page, "data-message", r"Error: cannot find prompts")
    assert "fill 'Prompt column' (or 'Messages column') (under 'Column names')" in error and "data." not in error
    page.get_by_text("Column names (empty: detected").click()
    fill(page, "data-col-prompt", "text")
    page.locator("#data-load").click()
    wait_text(page, "data-report", r"Rows:\s*3 · usable:\s*2 · bad:\s*1")
    bad = wait_text(page, "data-bad", r"not valid JSON")
    assert re.search(r"line 2\s+not valid JSON", bad), bad  # the file's second line, as an editor counts
    page.screenshot(path=str(ARTIFACTS / "6c-data-lines.png"), full_page=True)


def cpu_memory_panel_says_what_it_measures(page, run_dir: Path) -> None:
    """(e) The CPU run's memory lines are named for what they are: process RSS, and the plan's tensors."""
    open_tab(page, "Train")
    status = wait_text(page, "train-status", r"— (finished|crashed)", timeout_s=180)
    assert "finished" in status, (status, (run_dir / "app" / "train.log").read_text()[-2000:])
    assert json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["peak_mem_kind"] == "cpu_rss"
    deadline = time.monotonic() + 10
    while "1 iteration(s) logged" not in plot_texts(page, "train-plot") and time.monotonic() < deadline:
        time.sleep(0.25)
    texts = plot_texts(page, "train-plot")
    assert "CPU memory (GiB): process RSS and the plan's tensors" in texts, texts
    assert {"generation: process RSS", "generation: plan, tensors only"} <= set(texts)
    assert not [t for t in texts if t.endswith(" measured") or t.endswith(" planned")]


def export_lists_the_checkpoint_when_opened(page) -> None:
    """(d) The run was attached before its checkpoint existed: opening Export lists it, no Refresh pressed."""
    open_tab(page, "Export")
    page.wait_for_function("() => document.querySelector('#export-checkpoint input')?.value === 'iter_000001'",
                           timeout=20_000)


def reload_after_the_run_attaches_it(page, runs_root: Path, run_dir: Path) -> None:
    """(b) A reload after the run attaches it, so Evaluate and Export have it; (d) Export's list is filled
    when the tab opens, named as Evaluate names it, with the policy's dtype, and refuses in its own words."""
    page.reload()
    open_tab(page, "Train")
    wait_text(page, "train-message", r"Attached to the latest run " + re.escape(str(run_dir)) + r" \(finished\)")
    wait_text(page, "train-status", re.escape(str(run_dir)) + " — finished")
    assert value_of(page, "train-run-dir") != str(run_dir)  # a Start begins a new run
    open_tab(page, "Evaluate")
    page.wait_for_function("() => document.querySelector('#eval-checkpoint input')?.value === 'iter_000001'",
                           timeout=20_000)
    assert value_of(page, "eval-run-dir") == str(run_dir)
    open_tab(page, "Export")
    page.wait_for_function("() => document.querySelector('#export-checkpoint input')?.value === 'iter_000001'",
                           timeout=20_000)  # no Refresh pressed; the name Evaluate shows
    assert value_of(page, "export-run-dir") == str(run_dir)
    checked = page.evaluate("() => document.querySelector('#export-dtype input:checked')?.closest('label')?.innerText")
    assert (checked or "").strip() == "as the policy computed (fp32)", checked  # the CPU run's compute dtype
    out = Path(value_of(page, "export-out"))
    out.mkdir(parents=True)
    (out / "kept.txt").write_text("an earlier export")
    page.locator("#export-start").click()
    refusal = wait_text(page, "export-result", r"Error: ")
    assert "tick 'Overwrite' to replace it, or choose another 'Output directory'" in refusal
    assert not re.search(r"--[a-z]", refusal), refusal
    page.screenshot(path=str(ARTIFACTS / "6d-export-after-reload.png"), full_page=True)


def negative_kl_is_explained(page, run_dir: Path, tmp_path: Path) -> None:
    """(e) A k1 KL below 0 (the walk's -0.018) is explained on the panel that draws it. The run is the
    test's own run, copied with its KL set to the walk's figure (this run's policy never moved: KL 0)."""
    copy = tmp_path / "kl-below-zero"
    shutil.copytree(run_dir, copy)
    rows = [json.loads(line) for line in (copy / "metrics.jsonl").read_text().splitlines()]
    rows[-1]["kl_mean"] = -0.018
    (copy / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    open_tab(page, "Train")
    note = "k1 is unbiased: one batch's mean can be < 0; the KL itself is >= 0"
    box = page.locator("#train-runs input").first
    box.fill(str(copy))
    box.press("Enter")
    page.locator("#train-attach").click()  # draws the copy whatever a poll sent before it left (train_tab.redraw)
    wait_text(page, "train-status", re.escape(str(copy)))
    deadline = time.monotonic() + 30
    while note not in plot_texts(page, "train-plot") and time.monotonic() < deadline:
        time.sleep(0.25)
    texts = plot_texts(page, "train-plot")
    assert "KL to the reference (nats)" in texts and note in texts, texts
    page.screenshot(path=str(ARTIFACTS / "6e-train-kl-note.png"), full_page=True)


def test_the_dead_ends_of_a_walk(page, app_url, reward_dir, tmp_path):
    runs_root = app_url[1]
    run_dir = start_reload_and_see_its_settings(page, runs_root, reward_dir)
    apply_takes_the_recommended_placement(page)  # while the run trains
    a_plan_that_fits_nowhere_says_so(page)
    a_failed_load_clears_the_last_ones_results(page)
    data_tab_names_its_fields_and_lines(page, tmp_path)
    cpu_memory_panel_says_what_it_measures(page, run_dir)
    export_lists_the_checkpoint_when_opened(page)
    reload_after_the_run_attaches_it(page, runs_root, run_dir)
    negative_kl_is_explained(page, run_dir, tmp_path)

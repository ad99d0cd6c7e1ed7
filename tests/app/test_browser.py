"""The app in a real browser: Debian's Chromium, headless, driven by Playwright.

One walk through the workflow on the cpu-tiny setup, cheap enough for CI: a tiny random Llama as
the policy (``builtin:tiny-llama``), the reference as the base with the adapter off, and a tiny
sequence classifier built from code as the in-process reward model; one PPO iteration of two
prompts, at a learning rate that leaves the policy where it started (so the Evaluate tab meets two
identical answers, as after a short real run), then a second Start that crashes. Each numbered item
of issue 37 is an assertion here (marked "item N"). Screenshots of every tab go to ``test-artifacts/app/``.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from browser_kit import (
    ARTIFACTS, BROWSER_MARKS, cheap_overrides, choose, fill, open_tab, plot_texts, value_of, wait_text, wait_value,
)

pytestmark = BROWSER_MARKS


# How many lines a header's text takes on screen (a word broken over two lines gives 2).
LINES_OF_TEXT = """e => {
    const walker = document.createTreeWalker(e, NodeFilter.SHOW_TEXT);
    let node;
    while ((node = walker.nextNode()) && !node.textContent.trim()) {}
    const range = document.createRange();
    range.selectNodeContents(node);
    return new Set([...range.getClientRects()].map(r => Math.round(r.top))).size;
}"""
EMOJI = re.compile("[\u2600-\u27bf\U0001F000-\U0001FFFF]")  # empty boxes where only DejaVu fonts exist


def check_data_tab(page):
    open_tab(page, "Data")
    # Only the input of the source picked is shown (smaller items).
    assert page.locator("#data-builtin").is_visible() and not page.locator("#data-hub").is_visible()
    assert not page.locator("#data-upload").is_visible()
    page.get_by_label("hub id").check()
    page.locator("#data-hub").wait_for(state="visible")
    assert not page.locator("#data-builtin").is_visible()
    page.get_by_label("builtin").check()
    page.locator("#data-builtin").wait_for(state="visible")
    # Item 4: Use for training writes the source and purpose on screen, loading them first.
    choose(page, "data-builtin", "builtin:demo-pairs")
    page.locator("#data-load").click()
    wait_text(page, "data-report", r"builtin:demo-pairs[\s\S]*preference records")
    choose(page, "data-builtin", "builtin:demo")
    wait_value(page, "data-kind", "prompts (PPO)")
    page.locator("#data-use").click()
    wait_text(page, "data-message", r"Set data\.prompts=builtin:demo in")
    wait_text(page, "data-report", r"usable:\s*120")  # what was written is what is shown
    assert "prompt" in page.locator("#data-samples").inner_text()
    # The reward box's empty choice (the preset's reward model) is taken, not an error (smaller items).
    page.locator("#data-reward-check").click()
    wait_text(page, "data-reward-message", r"the preset's reward model")
    page.screenshot(path=str(ARTIFACTS / "1-data.png"), full_page=True)


def check_plan_tab(page, reward_dir):
    open_tab(page, "Plan")
    assert value_of(page, "plan-overrides").splitlines() == ["data.prompts=builtin:demo"]  # item 4, written
    page.locator("#plan-chart img").first.wait_for(state="visible")
    verdict = wait_text(page, "plan-verdict", r"peak \d+\.\d+ GiB")
    assert not EMOJI.search(verdict) and "--gpu-gib" not in verdict
    # Item 10: the table's total row is its first row, highlighted.
    first = page.locator('#plan-table [data-testid="cell-0-0"]')
    first.wait_for(state="visible")
    assert first.inner_text().strip() == "total"
    assert int(first.evaluate("e => getComputedStyle(e).fontWeight")) >= 600
    # Items 7 and 9: a new preset is planned at once; a consumer card's time is the H200's scaled to it.
    choose(page, "plan-preset", "3060-12g")
    wait_text(page, "plan-verdict", r"RTX 3060 12GB \(12 GiB\)")
    time_text = wait_text(page, "plan-time", r"H200 figures scaled to the RTX 3060 12GB by its published specs")
    assert "--set" not in time_text and not re.search(r"\d{4,}\.\d s", time_text)
    assert value_of(page, "plan-model") == "Qwen/Qwen2.5-1.5B-Instruct", page.locator("#plan-message").inner_text()
    fill(page, "plan-model", "google/gemma-2-9b")  # bf16 end to end: a 7B fits 12 GiB, a 9B is tight
    page.locator("#plan-run").click()
    wait_text(page, "plan-verdict", r"^TIGHT: tight on RTX 3060 12GB")
    page.locator("#plan-apply").click()
    wait_text(page, "plan-message", r"^Applied: actor\.optimizer=paged_adamw_8bit")  # smaller items: the Applied line stays
    page.screenshot(path=str(ARTIFACTS / "2a-plan-3060.png"), full_page=True)
    # Item 2: back on cpu-tiny the model is the preset's and the 3060's suggestion is taken out, said so.
    choose(page, "plan-preset", "cpu-tiny")
    wait_text(page, "plan-message", r"model builtin:demo-sft \(the preset's\)\. Took out the 3060-12g suggestion")
    assert value_of(page, "plan-model") == "builtin:demo-sft"
    assert value_of(page, "plan-overrides").splitlines() == ["data.prompts=builtin:demo"]
    wait_text(page, "plan-verdict", r"no GPU budget to check")
    # Item 7: a plan that fails leaves no verdict of the settings before it.
    fill(page, "plan-overrides", "ppo.iterations=zero")
    page.locator("#plan-run").click()
    wait_text(page, "plan-message", r"Error: config key 'ppo\.iterations'")
    assert page.locator("#plan-verdict").inner_text().strip() == ""
    fill(page, "plan-overrides", cheap_overrides(reward_dir))
    page.locator("#plan-run").click()
    wait_text(page, "plan-command", r"reward\.backend=hf")
    wait_text(page, "plan-verdict", r"peak \d+\.\d+ GiB")
    page.screenshot(path=str(ARTIFACTS / "2-plan.png"), full_page=True)


def start_and_reattach(page, runs_root) -> Path:
    """Item 3 (reload): start the run in the default directory, reload the page while it runs."""
    open_tab(page, "Train")
    run_dir = Path(value_of(page, "train-run-dir"))
    assert run_dir.parent == runs_root and run_dir.name.startswith("app-")
    page.locator("#train-start").click()
    wait_text(page, "train-message", r"Started: running \(pid \d+\)")
    wait_text(page, "train-progress", r"iteration 0/1", timeout_s=60)
    page.reload()
    open_tab(page, "Train")
    wait_text(page, "train-status", re.escape(str(run_dir)) + r" — running", timeout_s=10)
    wait_text(page, "train-message", r"Re-attached to the running run")
    assert value_of(page, "train-run-dir") == str(run_dir)  # the box follows what is attached
    assert value_of(page, "train-runs") == str(run_dir)
    return run_dir


def check_monitor(page, run_dir):
    status = wait_text(page, "train-status", r"finished|crashed", timeout_s=240)
    assert "finished" in status, page.locator("#train-log").inner_text()
    wait_text(page, "train-progress", r"iteration 1/1")
    assert "Started" not in page.locator("#train-message").inner_text()  # item 7: not a stale line
    assert "ETA" not in page.locator("#train-progress").inner_text()
    # Item 8: the monitor's one point reads on integer iteration ticks, under human titles.
    deadline = time.monotonic() + 10
    while "1 iteration(s) logged" not in plot_texts(page, "train-plot") and time.monotonic() < deadline:
        time.sleep(0.25)
    texts = plot_texts(page, "train-plot")
    assert "1 iteration(s) logged" in texts
    for title in ("Score and reward", "KL to the reference (nats)", "Policy and value loss", "KL penalty coefficient"):
        assert title in texts
    assert not [t for t in texts if "_" in t]  # no metric's internal name on the figure
    xticks = plot_texts(page, "train-plot", "g.xtick text")
    assert xticks and set(xticks) == {"1"}, xticks
    last_sample = json.loads((run_dir / "samples.jsonl").read_text().splitlines()[-1])
    prompt_text = re.sub(r"<\|[a-z]+\|>", "", last_sample["prompt"]).strip()
    assert prompt_text and prompt_text in page.locator("#train-samples").inner_text()
    assert [json.loads(line)["iteration"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1]
    page.screenshot(path=str(ARTIFACTS / "3-train.png"), full_page=True)


def check_evaluate(page, run_dir):
    open_tab(page, "Evaluate")
    # Item 6: the checkpoint written after Start is listed and selected without a click.
    page.wait_for_function(
        "() => document.querySelector('#eval-checkpoint input')?.value.includes('iter_000001')", timeout=20_000)
    assert page.locator("#eval-left-better").is_disabled()  # smaller items: nothing to judge yet
    page.get_by_text("Sampling", exact=True).click()  # 8 new tokens, not 48: four answers are generated
    tokens = page.locator("#eval-max-new input[type=number]")
    tokens.fill("8")
    tokens.press("Enter")
    fill(page, "eval-message", "Tell me about tea.")
    page.locator("#eval-send").click()
    left = wait_text(page, "eval-left-score", r"reward score: [-+]\d", timeout_s=120)
    assert left == wait_text(page, "eval-right-score", r"reward score: [-+]\d")
    # Item 1: identical answers say so, and what it means; Left/Right are off, Tie and Resample on.
    info = wait_text(page, "eval-info", r"The two answers are identical")
    assert "the policy has not moved here" in info and "KL to the reference so far" in info
    assert page.locator("#eval-left-better").is_disabled() and page.locator("#eval-right-better").is_disabled()
    assert page.locator("#eval-tie").is_enabled() and page.locator("#eval-resample").is_enabled()
    page.locator("#eval-resample").click()
    wait_text(page, "eval-info", r"identical \(seed 1\)")
    page.screenshot(path=str(ARTIFACTS / "4-evaluate.png"), full_page=True)
    page.locator("#eval-tie").click()
    info = wait_text(page, "eval-info", r"Recorded tie")
    assert "No preference pair yet" in info and "homerlhf reward --data" not in info
    assert not (run_dir / "preferences.jsonl").exists()  # no pair recorded
    tie = json.loads((run_dir / "preferences_ties.jsonl").read_text())
    assert tie["prompt"] == "Tell me about tea." and tie["response_a"] == tie["response_b"]
    assert Path(tie["checkpoint"]).name == "iter_000001" and tie["sampling"]["seed"] == 1


def second_start_crashes_whole(page, runs_root, run_dir, reward_dir, empty_model: Path):
    """Item 5: a model that is nowhere is refused before a run starts; items 3 and 5: a second Start
    gets a fresh directory, and its crash line is whole, in the status and in a toast."""
    open_tab(page, "Plan")
    fill(page, "plan-overrides", cheap_overrides(reward_dir, model="acme/not-here"))
    open_tab(page, "Train")
    page.locator("#train-start").click()  # refused without the download's retries: tests/stages/test_preflight.py
    wait_text(page, "train-message", r"Error: model\.name_or_path: 'acme/not-here' is neither a local model "
                                     r"directory nor in the hub cache, and the hub cannot be reached")
    assert len(list(runs_root.glob("app-*"))) == 1  # nothing started
    wait_text(page, "train-status", re.escape(str(run_dir)) + " — finished")  # a failed Start: the run before
    open_tab(page, "Plan")
    fill(page, "plan-overrides", cheap_overrides(reward_dir, model=str(empty_model)))
    open_tab(page, "Train")
    page.locator("#train-start").click()
    message = wait_text(page, "train-message", r"Started")
    # The monitor is cleared at once: never the first run's status under the second Start.
    assert str(run_dir) not in page.locator("#train-status").inner_text()
    second = Path(value_of(page, "train-run-dir"))
    assert second != run_dir and second.parent == runs_root and "already holds a run" not in message
    status = wait_text(page, "train-status", r"crashed", timeout_s=120)
    whole = f"error: {empty_model} has no config.json; point --model at a HF model dir"  # the planner's, whole
    assert whole in status, status
    page.locator(".toast-body").filter(has_text="The run crashed").first.wait_for(timeout=10_000)
    assert whole in page.locator(".toast-body").filter(has_text="The run crashed").first.inner_text()
    assert "Started" not in page.locator("#train-message").inner_text()
    page.screenshot(path=str(ARTIFACTS / "3b-train-crashed.png"), full_page=True)


def long_samples_in_view(page, root: Path):
    """Item 10: with replies as long as a real model's (the tiny run's are 8 tokens), the samples' score
    column is in view at 1400 px and "iteration" is on one line. The run is one written as a shell-started
    run would be, picked up with Attach (the Run directory box follows it: smaller items)."""
    shell_run = root / "shell-run"
    shell_run.mkdir()
    (shell_run / "metrics.jsonl").write_text(json.dumps({"iteration": 3, "score_mean": 1.25}) + "\n")
    reply = ("Happy to help! Tea is made by steeping the cured leaves of the tea plant in hot water; green, black "
             "and oolong teas come from the same plant and differ in how the leaves are processed after picking.")
    rows = [{"iteration": 3, "prompt": f"<|user|>Tell me about tea, part {i}.<|end|>", "response": reply,
             "score": 1.25 - i} for i in range(4)]
    (shell_run / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    box = page.locator("#train-runs input").first
    box.fill(str(shell_run))
    box.press("Enter")
    page.locator("#train-attach").click()
    wait_text(page, "train-status", re.escape(str(shell_run)))
    wait_text(page, "train-samples", r"part 3")
    assert value_of(page, "train-run-dir") == str(shell_run), value_of(page, "train-run-dir")
    headers = {h.inner_text().strip(): h for h in page.locator("#train-samples thead th").all()}
    score = headers["score"].bounding_box()
    assert 0 <= score["x"] and score["x"] + score["width"] <= 1400, score
    assert headers["iteration"].evaluate(LINES_OF_TEXT) == 1, "the iteration header wraps"
    page.screenshot(path=str(ARTIFACTS / "3c-train-attached.png"), full_page=True)


def check_export(page, run_dir: Path):
    """The Export tab (issue 36) on the run the workflow trained: the checkpoint list, an export with
    its progress bar, the written files and the commands to run them, then the refusal to overwrite."""
    open_tab(page, "Export")
    fill(page, "export-run-dir", str(run_dir))
    page.locator("#export-refresh").click()
    page.wait_for_function("() => document.querySelector('#export-checkpoint input')?.value === 'iter_000001'")
    out = run_dir.parent / "exports" / run_dir.name
    assert page.locator("#export-out textarea, #export-out input").first.input_value() == str(out)
    page.locator("#export-gguf").get_by_label("q4_k_m").uncheck()
    page.locator("#export-gguf").get_by_label("q8_0").check()
    page.locator("#export-start").click()
    # The bar shows once the export reports its first step (after its checks): as long as the export may take.
    page.locator("#export-result .progress-text, #export-result .eta-bar").first.wait_for(state="attached", timeout=240_000)
    text = wait_text(page, "export-result", r"Exported|Error", timeout_s=240)
    assert "Exported" in text, text
    assert "the trained policy up to rounding" in text and f"{run_dir.name}-q8_0.gguf" in text
    assert f"ollama create {run_dir.name} -f" in text and "llama-cli -m" in text
    assert (out / "model.safetensors").is_file() and (out / "gguf" / f"{run_dir.name}-q8_0.gguf").is_file()
    assert json.loads((out / "export.json").read_text())["checkpoint"].endswith("iter_000001")
    page.screenshot(path=str(ARTIFACTS / "5-export.png"), full_page=True)

    page.locator("#export-start").click()  # again, without Overwrite: the one-line refusal, nothing replaced
    wait_text(page, "export-result", r"already exists and is not empty; tick 'Overwrite' to replace it")
    assert (out / "export.json").is_file()


def test_workflow_in_chromium(page, app_url, reward_dir, tmp_path):
    runs_root = app_url[1]
    check_data_tab(page)
    check_plan_tab(page, reward_dir)
    run_dir = start_and_reattach(page, runs_root)
    check_monitor(page, run_dir)
    check_evaluate(page, run_dir)
    check_export(page, run_dir)
    (tmp_path / "empty-model").mkdir()
    second_start_crashes_whole(page, runs_root, run_dir, reward_dir, tmp_path / "empty-model")
    long_samples_in_view(page, tmp_path)


def test_reward_boxes_write_the_overrides_and_the_data_tab_checks_the_function(page, app_url):
    open_tab(page, "Plan")
    overrides = page.locator("#plan-overrides textarea").first

    def wait_lines(wanted: set[str]) -> None:
        deadline = time.monotonic() + 60
        while not wanted <= set(overrides.input_value().splitlines()) and time.monotonic() < deadline:
            time.sleep(0.25)
        assert wanted <= set(overrides.input_value().splitlines()), overrides.input_value()

    # Each box's event writes the overrides from both boxes as the browser had them when it was sent.
    # Two events sent within milliseconds are two requests that can reach the server in either order
    # (seen: the function box's, sent first with the components box still empty, ran last and took
    # the components line out), so the test leaves a box as a user does: after the first box's line
    # is in, not in the same instant.
    fill(page, "plan-reward-function", "builtin:reverse")
    wait_lines({"reward.backend=function", "reward.function=builtin:reverse"})
    fill(page, "plan-reward-components", "0.5 builtin:reverse-positions")
    wait_lines({"reward.backend=function", "reward.function=builtin:reverse",
                "reward.components=[{backend: function, function: 'builtin:reverse-positions', weight: 0.5}]"})

    # The Data tab scores the loaded rows with it: builtin:demo rows have no answer, so None.
    open_tab(page, "Data")
    page.locator("#data-load").click()
    wait_text(page, "data-report", r"usable:\s*120")
    page.locator("#data-reward-check").click()
    wait_text(page, "data-reward-table", r"None")

"""The app in a real browser: Debian's Chromium, headless, driven by Playwright.

One walk through the workflow on the cpu-tiny setup, cheap enough for CI: a tiny random Llama as
the policy (``builtin:tiny-llama``), the reference as the base with the adapter off, and a tiny
sequence classifier built from code as the in-process reward model; two PPO iterations of four
prompts. Screenshots of every tab go to ``test-artifacts/app/``.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "app"

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"{CHROMIUM} is missing (apt-get install chromium)"),
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cheap_overrides(reward_dir: Path) -> str:
    return "\n".join([
        "model.name_or_path=builtin:tiny-llama",
        "ref.backend=adapter_off",
        "reward.backend=hf",
        f"reward.model={reward_dir}",
        "ppo.iterations=2",
        "rollout.batch_size=4",
        "rollout.chunk_size=4",
        "rollout.max_new_tokens=8",
        "ppo.epochs=1",
        "ppo.mini_batch_size=4",
        "ppo.micro_batch_size=2",
        "checkpoint.every=1",
        "logging.samples_per_iteration=2",
    ])


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory):
    # Built before the app starts: the server thread imports transformers too, and its lazy module
    # is not safe to import from two threads at once.
    from homerlhf.tiny import build_sequence_classifier

    return build_sequence_classifier(tmp_path_factory.mktemp("tiny-rm"), arch="llama", seed=2)


@pytest.fixture(scope="module")
def app_url(tmp_path_factory, reward_dir):
    from homerlhf.app.ui import launch

    runs_root = tmp_path_factory.mktemp("app-runs")
    port = free_port()
    blocks = launch(host="127.0.0.1", port=port, block=False, runs_root=str(runs_root))
    yield f"http://127.0.0.1:{port}/", runs_root
    blocks.close()
    from homerlhf.app import runs

    for run_dir in runs.list_runs(runs_root):  # a failed test must not leave a detached trainer behind
        if runs.run_status(run_dir).running:
            runs.stop_run(run_dir, force=True)


@pytest.fixture(scope="module")
def page(app_url):
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(30_000)
        page.goto(app_url[0])
        yield page
        browser.close()


def open_tab(page, name: str) -> None:
    page.get_by_role("tab", name=name, exact=True).click()


def fill(page, elem_id: str, text: str) -> None:
    box = page.locator(f"#{elem_id} textarea, #{elem_id} input").first
    box.fill(text)
    box.dispatch_event("blur")


def wait_text(page, elem_id: str, pattern: str, timeout_s: float = 60) -> str:
    """Poll an element's text until it matches ``pattern`` (regex); return the text."""
    deadline = time.monotonic() + timeout_s
    text = ""
    while time.monotonic() < deadline:
        text = page.locator(f"#{elem_id}").inner_text()
        if re.search(pattern, text):
            return text
        time.sleep(0.25)
    raise AssertionError(f"#{elem_id} never matched {pattern!r}; last text: {text!r}")


def plot_src(page, elem_id: str) -> str:
    img = page.locator(f"#{elem_id} img")
    return img.first.get_attribute("src") if img.count() else ""


def test_workflow_in_chromium(page, app_url, reward_dir):
    runs_root = app_url[1]

    # Data: a builtin dataset, its detected format and counts.
    open_tab(page, "Data")
    page.locator("#data-load").click()
    wait_text(page, "data-report", r"usable:\s*120")
    assert "prompt" in page.locator("#data-samples").inner_text()
    page.screenshot(path=str(ARTIFACTS / "1-data.png"), full_page=True)

    # Plan: the chart renders (a matplotlib image), with the verdict and the command.
    open_tab(page, "Plan")
    page.locator("#plan-chart img").first.wait_for(state="visible")
    wait_text(page, "plan-verdict", r"peak \d+\.\d+ GiB")
    wait_text(page, "plan-time", r"Time per iteration")
    fill(page, "plan-overrides", cheap_overrides(reward_dir))
    page.locator("#plan-run").click()
    wait_text(page, "plan-command", r"reward\.backend=hf")
    page.screenshot(path=str(ARTIFACTS / "2-plan.png"), full_page=True)

    # Train: a short run as a detached process; the monitor gains points as iterations land.
    open_tab(page, "Train")
    run_dir = runs_root / "browser-run"
    fill(page, "train-run-dir", str(run_dir))
    page.locator("#train-start").click()
    wait_text(page, "train-message", r"Started")
    # The empty monitor first (the trainer takes a while to load its models) ...
    wait_text(page, "train-progress", r"iteration 0/2", timeout_s=60)
    page.locator("#train-plot img").first.wait_for(state="visible")
    empty_plot = plot_src(page, "train-plot")
    # ... then the same plot redrawn with the iterations' points once the run is done.
    status = wait_text(page, "train-status", r"finished|crashed", timeout_s=240)
    assert "finished" in status, page.locator("#train-log").inner_text()
    wait_text(page, "train-progress", r"iteration 2/2")
    deadline = time.monotonic() + 10
    while plot_src(page, "train-plot") == empty_plot and time.monotonic() < deadline:
        time.sleep(0.25)
    assert plot_src(page, "train-plot") != empty_plot
    last_sample = json.loads((run_dir / "samples.jsonl").read_text().splitlines()[-1])
    prompt_text = re.sub(r"<\|[a-z]+\|>", "", last_sample["prompt"]).strip()
    assert prompt_text and prompt_text in page.locator("#train-samples").inner_text()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2]
    page.screenshot(path=str(ARTIFACTS / "3-train.png"), full_page=True)

    # Evaluate: two answers with scores, then a preference lands in preferences.jsonl.
    open_tab(page, "Evaluate")
    page.locator("#eval-refresh").click()
    page.wait_for_function(
        "() => document.querySelector('#eval-checkpoint input')?.value.includes('iter_000002')")
    fill(page, "eval-message", "Tell me about tea.")
    page.locator("#eval-send").click()
    left = wait_text(page, "eval-left-score", r"reward score: [-+]\d", timeout_s=120)
    right = wait_text(page, "eval-right-score", r"reward score: [-+]\d")
    assert "Tell me about tea." in page.locator("#eval-left").inner_text()
    assert "Tell me about tea." in page.locator("#eval-right").inner_text()
    page.locator("#eval-left-better").click()
    wait_text(page, "eval-info", r"Recorded left")
    page.screenshot(path=str(ARTIFACTS / "4-evaluate.png"), full_page=True)

    pairs = (run_dir / "preferences.jsonl").read_text().splitlines()
    assert len(pairs) == 1
    record = json.loads(pairs[0])
    assert record["prompt"] == "Tell me about tea."
    assert record["chosen_source"] == "actor" and record["rejected_source"] == "reference"
    assert f"{record['chosen_score']:+.4f}" in left and f"{record['rejected_score']:+.4f}" in right
    assert os.path.basename(record["checkpoint"]) == "iter_000002"


def test_reward_boxes_write_the_overrides_and_the_data_tab_checks_the_function(page, app_url):
    open_tab(page, "Plan")
    fill(page, "plan-reward-function", "builtin:reverse")
    fill(page, "plan-reward-components", "0.5 builtin:reverse-positions")
    overrides = page.locator("#plan-overrides textarea").first
    deadline = time.monotonic() + 30
    while "reverse-positions" not in overrides.input_value() and time.monotonic() < deadline:
        time.sleep(0.25)
    items = overrides.input_value().splitlines()
    assert "reward.backend=function" in items and "reward.function=builtin:reverse" in items
    assert "reward.components=[{backend: function, function: 'builtin:reverse-positions', weight: 0.5}]" in items

    # The Data tab scores the loaded rows with it: builtin:demo rows have no answer, so None.
    open_tab(page, "Data")
    page.locator("#data-load").click()
    wait_text(page, "data-report", r"usable:\s*120")
    page.locator("#data-reward-check").click()
    wait_text(page, "data-reward-table", r"None")


def test_export_tab_exports_the_trained_run(page, app_url):
    """The Export tab on the run the workflow above trained: the checkpoint list, an export with its
    progress bar, the written files and the commands to run them."""
    run_dir = app_url[1] / "browser-run"
    if not (run_dir / "checkpoints").is_dir():
        pytest.skip("needs the run test_workflow_in_chromium trains")
    open_tab(page, "Export")
    fill(page, "export-run-dir", str(run_dir))
    page.locator("#export-refresh").click()
    page.wait_for_function("() => document.querySelector('#export-checkpoint input')?.value === 'last'")
    out = run_dir.parent / "exports" / "browser-run"
    assert page.locator("#export-out textarea, #export-out input").first.input_value() == str(out)
    page.locator("#export-gguf").get_by_label("q4_k_m").uncheck()
    page.locator("#export-gguf").get_by_label("q8_0").check()
    page.locator("#export-start").click()
    page.locator("#export-result .progress-text, #export-result .eta-bar").first.wait_for(state="attached", timeout=60_000)
    text = wait_text(page, "export-result", r"Exported|Error", timeout_s=240)
    assert "Exported" in text, text
    assert "the trained policy up to rounding" in text and "browser-run-q8_0.gguf" in text
    assert "ollama create browser-run -f" in text and "llama-cli -m" in text
    assert (out / "model.safetensors").is_file() and (out / "gguf" / "browser-run-q8_0.gguf").is_file()
    assert json.loads((out / "export.json").read_text())["checkpoint"].endswith("iter_000002")
    page.screenshot(path=str(ARTIFACTS / "5-export.png"), full_page=True)

    page.locator("#export-start").click()  # again, without Overwrite: the one-line refusal, nothing replaced
    wait_text(page, "export-result", r"already exists and is not empty; pass --overwrite")
    assert (out / "export.json").is_file()

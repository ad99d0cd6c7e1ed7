"""The app's browser fixtures: a tiny reward model, the app served on a free local port, one Chromium page.
Module-scoped: each browser test module gets its own app and page."""

from __future__ import annotations

import pytest
from browser_kit import ARTIFACTS, CHROMIUM, CHROMIUM_ARGS, free_port, wait_page_loaded


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
        wait_page_loaded(page)
        yield page
        browser.close()

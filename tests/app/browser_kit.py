"""What the browser tests share: Debian's Chromium, the cheap cpu-tiny overrides and the page helpers
(the fixtures that start the app and the browser are in conftest.py)."""

from __future__ import annotations

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

# Every browser test module sets ``pytestmark = BROWSER_MARKS``.
BROWSER_MARKS = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"{CHROMIUM} is missing (apt-get install chromium)"),
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cheap_overrides(reward_dir: Path, model: str = "builtin:tiny-llama") -> str:
    return "\n".join([
        f"model.name_or_path={model}",
        "ref.backend=adapter_off",
        "reward.backend=hf",
        f"reward.model={reward_dir}",
        "ppo.iterations=1",
        "actor.lr=1e-9",  # the policy does not move: the actor answers as the reference does
        "rollout.batch_size=2",
        "rollout.chunk_size=2",
        "rollout.max_new_tokens=6",
        "ppo.epochs=1",
        "ppo.mini_batch_size=2",
        "ppo.micro_batch_size=2",
        "checkpoint.every=1",
        "logging.samples_per_iteration=2",
    ])


def open_tab(page, name: str) -> None:
    page.get_by_role("tab", name=name, exact=True).click()


def fill(page, elem_id: str, text: str) -> None:
    box = page.locator(f"#{elem_id} textarea, #{elem_id} input").first
    box.fill(text)
    # Leave the box as a user does (focus moves out, one blur event): a blur only dispatched leaves the
    # focus there, and the next box to take it sends this box's blur a second time, with that box still
    # empty, in the same instant as its own (the two requests can arrive in either order).
    box.blur()


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


def wait_page_loaded(page) -> None:
    """Wait for the page's load events to end (their last step writes the Train tab's Start command, with its
    ``--out``), then show the first tab, as the page opened. A box typed into before they end can be
    overwritten by a load step that read the page before the typing (seen under a CI's load)."""
    open_tab(page, "Train")
    wait_text(page, "train-command", r"--out \S")
    open_tab(page, "Data")


def value_of(page, elem_id: str) -> str:
    return page.locator(f"#{elem_id} textarea, #{elem_id} input").first.input_value()


def wait_value(page, elem_id: str, expected: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while value_of(page, elem_id) != expected and time.monotonic() < deadline:
        time.sleep(0.25)
    assert value_of(page, elem_id) == expected


def choose(page, elem_id: str, option: str) -> None:
    page.locator(f"#{elem_id} input").first.click()
    page.get_by_role("option", name=option, exact=True).click()


PLOT_TEXTS = """([id, selector]) => [...document.querySelectorAll(`#${id} svg ${selector}`)].map(text => {
    const lines = text.querySelectorAll("tspan.line");  // a wrapped text: one tspan per line
    return (lines.length ? [...lines].map(line => line.textContent).join(" ") : text.textContent).trim(); })"""


def plot_texts(page, elem_id: str, selector: str = "text") -> list[str]:
    """The texts of a plot as a person reads them: titles, legend names, notes, ticks (a wrapped one whole)."""
    return page.evaluate(PLOT_TEXTS, [elem_id, selector])

"""The monitor's sample history in Chromium: a run written as a trainer writes one (four iterations of
samples, then a fifth while the page watches) is attached; the slider stands at the newest iteration,
moved back it shows that iteration's samples and its best and worst, and the prompt picked shows its
answers across iterations, the fifth's included once it is written. The audit verdict over the figure
flags the answers' growth and follows the run too. Screenshot:
``test-artifacts/app/7-sample-history.png``."""

from __future__ import annotations

import json
from pathlib import Path

from browser_kit import ARTIFACTS, BROWSER_MARKS, open_tab, wait_text

pytestmark = BROWSER_MARKS


def _iteration(it: int) -> list[dict]:
    """Two prompts answered at each iteration, longer and better scored as the run goes on."""
    return [{"iteration": it, "prompt": f"<|user|>{prompt}<|end|>", "response": f"{word} answer {it} " * it,
             "score": round(sign * 0.5 * it, 3), "truncated": it == 4, "rank": "first"}
            for prompt, word, sign in (("Name a colour.", "colour", 1), ("Say something kind.", "kind", -1))]


def _write(run: Path, iterations) -> None:
    with (run / "metrics.jsonl").open("a") as fh:
        # Mean length over the first iterations' (signal_length_drift) past 1.5 from iteration 2: flagged from 3.
        fh.writelines(json.dumps({"iteration": it, "score_mean": 0.0, "signal_length_drift": float(it)}) + "\n"
                      for it in iterations)
    with (run / "samples.jsonl").open("a") as fh:
        fh.writelines(json.dumps(row) + "\n" for it in iterations for row in _iteration(it))


def _move_slider(page, steps: int) -> None:
    """As a user moves the slider with the keyboard: ``steps`` iterations back."""
    handle = page.locator("#train-history-iteration input[type=range]").first
    handle.focus()
    for _ in range(steps):
        handle.press("ArrowLeft")


def test_the_slider_shows_each_iterations_samples_while_the_run_grows(page, tmp_path):
    run = tmp_path / "history-run"
    run.mkdir()
    _write(run, [1, 2, 3, 4])
    open_tab(page, "Train")
    box = page.locator("#train-runs input").first
    box.fill(str(run))
    box.press("Enter")
    page.locator("#train-attach").click()
    wait_text(page, "train-history-summary", r"Iteration 4 · 2 sample\(s\) kept")
    assert "colour answer 4" in page.locator("#train-history-samples").inner_text()
    wait_text(page, "train-audit", r"(?s)Audit: 1 flag\(s\) raised.*length_drift at iteration\(s\) 3-4")

    _move_slider(page, 2)  # from 4 to 2
    wait_text(page, "train-history-summary", r"Iteration 2 · 2 sample\(s\) kept · mean score 0 \(min -1, max 1\)")
    samples = page.locator("#train-history-samples").inner_text()
    assert "colour answer 2" in samples and "answer 4" not in samples
    best, worst = (page.locator(f"#train-history-{name}").inner_text() for name in ("top", "bottom"))
    assert best.index("colour answer 2") < best.index("kind answer 2"), best  # scores 1 and -1
    assert worst.index("kind answer 2") < worst.index("colour answer 2"), worst

    wait_text(page, "train-history-across", r"colour answer 4")  # the prompt answered most: the first one
    _write(run, [5])  # the run goes on; the slider, moved back, stays at 2
    wait_text(page, "train-history-across", r"colour answer 5")
    wait_text(page, "train-audit", r"length_drift at iteration\(s\) 3-5")
    assert "Iteration 2 ·" in page.locator("#train-history-summary").inner_text()
    page.locator("#train-history").scroll_into_view_if_needed()
    page.screenshot(path=str(ARTIFACTS / "7-sample-history.png"), full_page=True)

"""What a finished feedback run (*Train on my feedback*) did, in the Evaluate tab's words.

The run's ``preference_run.json`` holds each answer's log-probability under the new policy and under the
checkpoint it started from, on the rows it trained on (``trained_rows``) and on the held-out ones
(``held_out``: prompts of the user's feedback it never saw, when there were enough to hold some out).
From them: the margin ``log p(chosen) - log p(rejected)`` before and after, and DPO's own measure of what
changed, the probability its implicit reward gives the chosen answer over the rejected one,
``sigmoid(beta * (margin_after - margin_before))``: 50% before any training. Below :data:`MOVED` the run
is said to have been too little to matter, with what to do about it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

from homerlhf.app import feedback
from homerlhf.app.feedback_runs import RESULT_FILE, info_of
from homerlhf.app.monitor import read_jsonl

MOVED = 0.55  # an implied preference under this after training: too little to matter


def implied_preference(beta: float, margin_change: float) -> float:
    """``sigmoid(beta * margin_change)``: the chosen answer's probability over the rejected one under the
    trained policy's implicit reward (0.5 at its start)."""
    return 1.0 / (1.0 + math.exp(-beta * margin_change))


def _change(figures: dict) -> Optional[float]:
    """The margin's change: pairs' ``margin_after - margin_before``, else rated answers' up-change - down-change."""
    if "margin_after" in figures:
        return figures["margin_after"] - figures["margin_before"]
    if figures.get("good_logp_change") is not None and figures.get("bad_logp_change") is not None:
        return figures["good_logp_change"] - figures["bad_logp_change"]
    return None


def figures_words(figures: dict, beta: float) -> str:
    """One set of figures as a sentence ('' for none)."""
    parts = []
    if "margin_after" in figures:
        parts.append(f"margin log p(chosen) - log p(rejected) {figures['margin_before']:+.3f} -> "
                     f"{figures['margin_after']:+.3f} nats (chosen answers **{figures['chosen_logp_change']:+.3f}**, "
                     f"rejected {figures['rejected_logp_change']:+.3f})")
    for name, word in (("good_logp_change", "answers rated up"), ("bad_logp_change", "answers rated down")):
        if figures.get(name) is not None:
            parts.append(f"{word} {figures[name]:+.3f}")
    change = _change(figures)
    if change is not None:
        parts.append(f"preference for {_preferred(figures)} 50% -> {100 * implied_preference(beta, change):.1f}%")
    return "; ".join(parts)


def _preferred(figures: dict) -> str:
    return "your chosen answers" if "margin_after" in figures else "the answers you rated up over those rated down"


def _loss_words(run_dir: Path) -> str:
    losses = [r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if isinstance(r.get("loss"), (int, float))]
    return f", loss {losses[0]:.4f} -> {losses[-1]:.4f}" if len(losses) >= 2 else ""


def too_little(summary: dict, info: dict, run_dir: Path, beta: float) -> str:
    """The line saying the run was too little to move the policy, and what to do ('' when it moved)."""
    trained = summary.get("trained_rows") or {}
    change = _change(trained)
    if change is None or implied_preference(beta, change) >= MOVED:
        return ""
    method = summary["stage"]
    return (f"**Too little to matter:** {summary['steps']} step(s) on {summary['n_train']} row(s) left the preference "
            f"for {_preferred(trained)} at {100 * implied_preference(beta, change):.1f}% (50% is no change"
            f"{_loss_words(run_dir)}). Give more feedback (tens of pairs), or train longer: raise `{method}.epochs` "
            f"(now {info.get('epochs')}) or `{method}.lr` in the Plan tab's overrides, then train again.")


def result_markdown(run_dir: str | Path) -> str:
    """What a finished feedback run did to the feedback ('' before it ends, or for a run not started here)."""
    info = info_of(run_dir)
    try:
        summary = json.loads((Path(run_dir) / RESULT_FILE).read_text())
    except (OSError, ValueError):
        return ""
    if info is None:  # a run started elsewhere trained on other data
        return ""
    beta, start = float(info.get("beta") or 0.1), Path(info["start_checkpoint"])
    new = Path(summary["checkpoint"]).name
    lines = [f"**{summary['stage'].upper()} run finished**: {summary['steps']} optimizer step(s) on "
             f"{summary['n_train']} row(s). Evaluate compares its checkpoint `{new}` (left) with `{start.name}` of "
             f"`{feedback.owner_run(start).name}`, where it started (right): send one of your prompts to see the change."]
    trained = figures_words(summary.get("trained_rows") or {}, beta)
    if trained:
        lines.append(f"On your feedback it trained on: {trained}.")
    held = figures_words(summary.get("held_out") or {}, beta) if info.get("held_out") else ""
    lines.append(f"On your held-out feedback (prompts it never saw): {held}." if held else
                 f"No held-out figure: from {feedback.MIN_PROMPTS_HELD} prompts with feedback on, a fifth of them "
                 "is held out to show what the run does to prompts it never saw.")
    lines.append(too_little(summary, info, Path(run_dir), beta))
    return "\n\n".join(line for line in lines if line)

"""The monitor's sample history: a run's ``samples.jsonl`` read into what the history panel shows, by
iteration (that iteration's samples, its best and worst by reward) and by prompt (one prompt's answers
across iterations, side by side).

A row is ``{"iteration", "prompt", "response", "score", "truncated", "rank"}``; ``rank`` says why the
trainer kept it: ``first`` (the first samples of the batch), ``top`` or ``bottom`` (the batch's best or
worst by reward). A row without one is a ``first`` row (runs written before ranks were kept). The same
answer kept for two reasons (one of the first and also the best) is one sample here.

Plain functions over lists of dicts: the file is read with :func:`homerlhf.app.monitor.read_jsonl`, which
skips a line still being written, so a growing run reads as the iterations whole so far and its last one
as far as it got.
"""

from __future__ import annotations

import math
import re
from typing import Optional, Sequence

RANKS = ("first", "top", "bottom")
COLUMNS = ["kept as", "prompt", "response", "score", "cut at max tokens"]
RANKED_COLUMNS = ["score", "prompt", "response"]  # the best and worst, side by side: the score first, in view
ACROSS_COLUMNS = ["iteration", "response", "score", "cut at max tokens"]
_SPECIAL = re.compile(r"<\|[A-Za-z0-9_]+\|>")  # chat-template markers: noise in a table of prompts


def rank_of(row: dict) -> str:
    rank = row.get("rank")
    return rank if rank in RANKS else "first"


def score_of(row: dict) -> Optional[float]:
    value = row.get("score", row.get("reward"))
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def prompt_text(row: dict) -> str:
    """The row's prompt as a person reads it: without chat-template markers, whitespace as single spaces."""
    text = _SPECIAL.sub(" ", str(row.get("prompt", row.get("query", ""))))
    return re.sub(r"\s+", " ", text).strip()


def iteration_key(row: dict) -> Optional[int]:
    value = row.get("iteration", row.get("iter"))
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return int(value)


def by_iteration(rows: Sequence[dict]) -> dict[int, list[dict]]:
    """Each iteration's samples, in the order written. A row of the same answer as a sample already there
    but kept for another reason (the ``top`` row of one of the ``first``) joins it; two equal answers both
    kept as ``first`` (a group that answered alike) stay two."""
    out: dict[int, list[dict]] = {}
    for row in rows:
        it = iteration_key(row)
        if it is None:
            continue
        sample = {"iteration": it, "prompt": prompt_text(row), "response": str(row.get("response", "")),
                  "score": score_of(row), "truncated": bool(row.get("truncated", False)), "ranks": [rank_of(row)]}
        kept = out.setdefault(it, [])
        same = next((s for s in kept if _same(s, sample) and sample["ranks"][0] not in s["ranks"]), None)
        if same is None:
            kept.append(sample)
        else:
            same["ranks"].append(sample["ranks"][0])
    return {it: out[it] for it in sorted(out)}


def _same(a: dict, b: dict) -> bool:
    return (a["prompt"], a["response"], a["score"]) == (b["prompt"], b["response"], b["score"])


def nearest(iterations: Sequence[int], wanted: Optional[float]) -> Optional[int]:
    """The iteration with samples closest to ``wanted`` (the later one on a tie); None when there is none.
    A run that keeps samples of only some iterations leaves gaps a slider can stop on."""
    if not iterations:
        return None
    if wanted is None:
        return iterations[-1]
    return min(iterations, key=lambda it: (abs(it - wanted), -it))


def _row(sample: dict) -> list:
    score = sample["score"]
    return [", ".join(sample["ranks"]), sample["prompt"], sample["response"],
            None if score is None else round(score, 4), "yes" if sample["truncated"] else ""]


def iteration_rows(samples: Sequence[dict]) -> list[list]:
    """One iteration's samples as table rows (``COLUMNS``), as the trainer kept them."""
    return [_row(s) for s in samples]


def top_bottom(samples: Sequence[dict], k: int) -> tuple[list[list], list[list]]:
    """The ``k`` best and the ``k`` worst samples of one iteration by score (``RANKED_COLUMNS``), best (worst)
    first. With fewer
    than ``2k`` scored samples the two tables share some."""
    scored = [s for s in samples if s["score"] is not None]
    ordered = sorted(scored, key=lambda s: s["score"], reverse=True)
    k = max(0, int(k))
    return [_ranked(s) for s in ordered[:k]], [_ranked(s) for s in list(reversed(ordered))[:k]]


def _ranked(sample: dict) -> list:
    cut = " [cut at max tokens]" if sample["truncated"] else ""
    return [round(sample["score"], 4), sample["prompt"], sample["response"] + cut]


def summary(iteration: int, samples: Sequence[dict], wanted: Optional[float] = None) -> str:
    """A line over the iteration's tables: how many samples, their mean score and how many hit the token cap."""
    scores = [s["score"] for s in samples if s["score"] is not None]
    parts = [f"**Iteration {iteration}**", f"{len(samples)} sample(s) kept"]
    if scores:
        parts.append(f"mean score {sum(scores) / len(scores):.4g} (min {min(scores):.4g}, max {max(scores):.4g})")
    cut = sum(1 for s in samples if s["truncated"])
    if cut:
        parts.append(f"{cut} cut at max tokens")
    line = " · ".join(parts)
    if wanted is not None and int(wanted) != iteration:
        line += f" (iteration {int(wanted)} kept no samples: the nearest shown)"
    return line


def prompts(history: dict[int, list[dict]]) -> list[str]:
    """The prompts of the run, those answered in the most iterations first (then in the order first seen)."""
    seen: dict[str, set[int]] = {}
    for it, samples in history.items():
        for s in samples:
            seen.setdefault(s["prompt"], set()).add(it)
    order = list(seen)
    return sorted(order, key=lambda p: (-len(seen[p]), order.index(p)))


def across(history: dict[int, list[dict]], prompt: str) -> list[list]:
    """``prompt``'s answers in every iteration that kept one, oldest first (``ACROSS_COLUMNS``)."""
    out = []
    for it, samples in history.items():
        for s in samples:
            if s["prompt"] == prompt:
                score = s["score"]
                out.append([it, s["response"], None if score is None else round(score, 4),
                            "yes" if s["truncated"] else ""])
    return out

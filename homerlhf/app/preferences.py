"""Human preferences from the Evaluate tab, written where ``homerlhf reward`` can train on them.

``RUN_DIR/preferences.jsonl`` gets one object per "left better" / "right better" click:
``{"prompt", "chosen", "rejected"}`` as plain text (the loader's prompt/chosen/rejected format),
plus provenance fields the loader ignores: ``chosen_source``/``rejected_source`` ("actor" or
"reference"), ``checkpoint``, ``chosen_score``/``rejected_score`` (reward model), ``sampling``, ``time``.
So ``homerlhf reward --data RUN_DIR/preferences.jsonl`` trains on them as they are, and evaluates
on them too: a ``data.eval_fraction`` of their prompts held out, never a preset's builtin pairs
(:mod:`homerlhf.data.heldout`); :func:`held_out_note` says what a reward model trained on the pairs
so far would report.

A tie says neither answer is better, which a Bradley-Terry pair cannot express, and
``chosen == rejected`` rows are rejected by the loader. Ties therefore go to a separate file,
``RUN_DIR/preferences_ties.jsonl`` (``{"prompt", "response_a", "response_b", ...}``), kept for
later use (e.g. a margin or ties-aware loss) and never mixed into the pairs file.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Optional

from homerlhf.data.heldout import MIN_HELDOUT, half_width, pairs_needed

PAIRS_FILE = "preferences.jsonl"
TIES_FILE = "preferences_ties.jsonl"
CHOICES = ("left", "right", "tie")


def append_record(path: Path, record: dict) -> None:
    """One JSON line appended and synced (also the ratings file's writer)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps(record, ensure_ascii=False) + "\n"
    # One write of one line in append mode: concurrent clicks never interleave half lines.
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(line)
        fh.flush()
        os.fsync(fh.fileno())


def record_preference(
    run_dir: str | Path,
    prompt: str,
    left: str,
    right: str,
    choice: str,
    left_source: str = "actor",
    right_source: str = "reference",
    left_score: Optional[float] = None,
    right_score: Optional[float] = None,
    extra: Optional[dict] = None,
) -> Path:
    """Append one judgement; returns the file written (pairs file, or the ties file for a tie)."""
    if choice not in CHOICES:
        raise ValueError(f"choice must be one of {CHOICES}, got {choice!r}")
    meta = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), **(extra or {})}
    run_dir = Path(run_dir)
    if choice == "tie" or left == right:
        path = run_dir / TIES_FILE
        append_record(path, {"prompt": prompt, "response_a": left, "response_b": right,
                              "a_source": left_source, "b_source": right_source,
                              "a_score": left_score, "b_score": right_score, **meta})
        return path
    if choice == "left":
        chosen, rejected = (left, left_source, left_score), (right, right_source, right_score)
    else:
        chosen, rejected = (right, right_source, right_score), (left, left_source, left_score)
    path = run_dir / PAIRS_FILE
    append_record(path, {"prompt": prompt, "chosen": chosen[0], "rejected": rejected[0],
                          "chosen_source": chosen[1], "rejected_source": rejected[1],
                          "chosen_score": chosen[2], "rejected_score": rejected[2], **meta})
    return path


def count(run_dir: str | Path) -> tuple[int, int]:
    """(pairs, ties) recorded so far in ``run_dir``."""

    def lines(path: Path) -> int:
        try:
            with open(path, encoding="utf-8") as fh:
                return sum(1 for line in fh if line.strip())
        except OSError:
            return 0

    run_dir = Path(run_dir)
    return lines(run_dir / PAIRS_FILE), lines(run_dir / TIES_FILE)


def held_out_note(pairs: int, eval_fraction: float = 0.1) -> str:
    """What ``homerlhf reward --data`` on ``pairs`` recorded pairs reports: a held-out accuracy on
    their own held-out prompts, or (too few) its training accuracy only, and from how many pairs on
    a held-out figure comes (at ``data.eval_fraction``, the default 0.1)."""
    needed = pairs_needed(eval_fraction)
    if needed is None or pairs < needed:
        more = "" if needed is None else f" until {needed} pairs (at data.eval_fraction {eval_fraction:g})"
        return (f"with {pairs} pair(s) it reports its training accuracy only{more}: a held-out figure on these "
                f"pairs needs {MIN_HELDOUT} held-out ones (+-{half_width(MIN_HELDOUT):.2f} at 95%)")
    return (f"it holds out about {int(pairs * eval_fraction + 0.5)} of these pairs by prompt and reports its "
            "accuracy on them")

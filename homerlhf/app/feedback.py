"""The feedback the Evaluate tab collects for one policy, in the files the DPO / KTO stages read.

Every record is in the evaluated checkpoint's own run directory and names that ``checkpoint``:

- a pair, *Left/Right better* (:mod:`homerlhf.app.preferences`): ``RUN_DIR/preferences.jsonl``;
- a rating, *Thumbs up / down* on one answer: ``RUN_DIR/ratings.jsonl`` (:func:`record_rating`);
- drafts: *Another draft* samples the actor once more (the next seed); *Best of these* records the
  picked answer as the chosen side of a pair against every other answer on screen (:func:`record_best`):
  DPO's data, and for KTO one good and one bad answer each.

:func:`write_training_data` copies one policy's rows into a feedback run's own directory, so the run
trains on (and ``--resume`` finds) exactly what was collected when it started.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from homerlhf.app import preferences
from homerlhf.data.ratings import RATINGS_FILE


def owner_run(checkpoint: str | Path) -> Path:
    """The run directory a checkpoint belongs to (``RUN/checkpoints/iter_XXXXXX``)."""
    return Path(checkpoint).parent.parent


def record_rating(run_dir: str | Path, prompt: str, completion: str, good: bool, source: str,
                  score: Optional[float] = None, extra: Optional[dict] = None) -> Path:
    """Append one rated answer to ``RUN_DIR/ratings.jsonl``; returns the file.

    Rows are ``{"prompt", "completion", "label"}`` (:data:`homerlhf.data.ratings.RATINGS_FILE`) plus
    provenance the loader ignores: ``completion_source``, ``checkpoint``, ``sampling``, ``reward_score``, ``time``."""
    path = Path(run_dir) / RATINGS_FILE
    preferences.append_record(path, {"prompt": prompt, "completion": completion, "label": bool(good),
                                     "completion_source": source, "reward_score": score,
                                     "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **(extra or {})})
    return path


def record_best(run_dir: str | Path, prompt: str, answers: list[dict], best: int, extra: Optional[dict] = None,
                done: frozenset = frozenset()) -> list[tuple[str, str]]:
    """``answers[best]`` preferred to every other answer whose text differs: one pair each, skipping the
    (chosen, rejected) texts in ``done``. Returns the pairs written as (chosen, rejected) texts.

    The other answers are the reference's and the other drafts; a pair already recorded for this
    exchange is not written twice."""
    chosen = answers[best]
    written = []
    for i, other in enumerate(answers):
        key = (chosen["text"], other["text"])
        if i == best or other["text"] == chosen["text"] or key in done or key in written:
            continue
        preferences.record_preference(run_dir, prompt, chosen["text"], other["text"], "left",
                                      left_source=chosen["source"], right_source=other["source"],
                                      left_score=chosen.get("score"), right_score=other.get("score"), extra=extra)
        written.append(key)
    return written


def _rows(path: Path) -> list[dict]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    rows = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:  # a line still being written
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def _same(a, b) -> bool:
    try:
        return Path(a).resolve() == Path(b).resolve()
    except (TypeError, OSError):
        return False


@dataclass
class Feedback:
    """One policy's collected rows: pairs (``preferences.jsonl``) and rated answers (``ratings.jsonl``)."""

    pairs: list[dict] = field(default_factory=list)
    ratings: list[dict] = field(default_factory=list)

    @property
    def good(self) -> int:
        return sum(1 for r in self.ratings if r.get("label") is True)

    @property
    def bad(self) -> int:
        return len(self.ratings) - self.good

    def line(self) -> str:
        return (f"{len(self.pairs)} preference pair(s) and {len(self.ratings)} rated answer(s) "
                f"({self.good} up, {self.bad} down)")


def policy_feedback(checkpoint: str | Path) -> Feedback:
    """The rows recorded for ``checkpoint`` in its run's files (pairs, ratings); ties are no training data."""
    run = owner_run(checkpoint)
    mine = lambda rows: [r for r in rows if _same(r.get("checkpoint"), checkpoint)]  # noqa: E731
    return Feedback(mine(_rows(run / preferences.PAIRS_FILE)), mine(_rows(run / RATINGS_FILE)))


def counts_markdown(checkpoint: Optional[str]) -> str:
    """The count line under the feedback buttons: what has been collected for the picked policy."""
    if not checkpoint:
        return "Feedback for this policy: pick a checkpoint first."
    fb = policy_feedback(checkpoint)
    run = owner_run(checkpoint)
    return (f"**Collected for this policy** (`{Path(checkpoint).name}` of `{run.name}`): {fb.line()}, "
            f"in `{run / preferences.PAIRS_FILE}` and `{run / RATINGS_FILE}`.")


PAIRS_DATA = "pairs.jsonl"
RATED_DATA = "rated.jsonl"
HELD_DATA = "held_out.jsonl"
HELD_FRACTION = 0.2  # of the prompts, held out when there are MIN_PROMPTS_HELD or more
MIN_PROMPTS_HELD = 3


def training_rows(fb: Feedback, method: str) -> list[dict]:
    """The rows a feedback run trains on: DPO the pairs as they are; KTO the rated answers plus each pair as
    its chosen answer (good) and its rejected one (bad)."""
    if method == "dpo":
        return [{"prompt": p["prompt"], "chosen": p["chosen"], "rejected": p["rejected"]} for p in fb.pairs]
    rows = [{"prompt": r["prompt"], "completion": r["completion"], "label": bool(r["label"])} for r in fb.ratings]
    return rows + [{"prompt": p["prompt"], "completion": p[side], "label": side == "chosen"}
                   for p in fb.pairs for side in ("chosen", "rejected")]


def held_out_split(rows: list[dict], method: str, min_rows: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(train, held out): whole prompts held out (about :data:`HELD_FRACTION` of the rows) to measure what the run
    does to feedback it never saw, when the rows hold :data:`MIN_PROMPTS_HELD` prompts or more and the rest still
    reaches ``min_rows`` (KTO: a pair's two answers count two, as ``kto.min_rows`` counts them); else nothing."""
    from homerlhf.data.heldout import prompt_key, split_by_prompt

    keys = [prompt_key(r["prompt"]) for r in rows]
    if len(set(keys)) < MIN_PROMPTS_HELD:
        return rows, []
    train, held = split_by_prompt(keys, HELD_FRACTION, seed)
    if not held or len(train) < min_rows:
        return rows, []
    return [rows[i] for i in train], [rows[i] for i in held]


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    return path


def write_training_data(fb: Feedback, method: str, folder: Path, min_rows: int = 0) -> tuple[Path, Optional[Path]]:
    """The rows a feedback run trains on as one file in ``folder`` (:func:`training_rows`), and the prompts held
    out of them as another (:func:`held_out_split`; None when none are)."""
    folder.mkdir(parents=True, exist_ok=True)
    train, held = held_out_split(training_rows(fb, method), method, min_rows)
    path = _write(folder / (PAIRS_DATA if method == "dpo" else RATED_DATA), train)
    return path, (_write(folder / HELD_DATA, held) if held else None)

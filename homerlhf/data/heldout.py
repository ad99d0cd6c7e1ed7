"""Where a stage's held-out figure comes from: the data it trained on, never another task's.

A preset's ``rm.eval_data`` may name a builtin held-out set (``cpu-tiny``: ``builtin:demo-pairs-heldout``).
That set measures the builtin task, so it is used only with that task's own training data
(:data:`BUILTIN_HELDOUT`); a user's ``--data`` brings its own evaluation: a ``data.eval_fraction``
split of the user's rows, by prompt (:func:`split_by_prompt`: every pair of one prompt on the same
side). ``--eval-data`` (or a non-builtin ``rm.eval_data``) is used as given.

A split too small to say anything is not reported: the held-out accuracy of ``n`` pairs has a 95%
half-width of up to ``1.96 * 0.5 / sqrt(n)`` (:func:`half_width`, the binomial's worst case,
accuracy 0.5); below :data:`MIN_HELDOUT` pairs (a half-width above :data:`MAX_HALF_WIDTH`) the stage
trains on every pair, reports its training accuracy only and says how many pairs would give a
held-out figure (:func:`too_small_note`).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from typing import Any, Optional, Sequence

Z95 = 1.96  # the normal quantile of a two-sided 95% interval
MAX_HALF_WIDTH = 0.15  # the widest 95% interval a reported held-out accuracy may have
MIN_HELDOUT = math.ceil((Z95 * 0.5 / MAX_HALF_WIDTH) ** 2)  # 43 pairs: 1.96 * 0.5 / sqrt(43) = 0.149

# A builtin held-out set -> the training set of the task it measures.
BUILTIN_HELDOUT = {"builtin:demo-pairs-heldout": "builtin:demo-pairs", "builtin:reverse-heldout": "builtin:reverse",
                   "builtin:capitals-heldout": "builtin:capitals",
                   "builtin:capitals-pairs-heldout": "builtin:capitals-pairs"}


def half_width(n: int) -> float:
    """The 95% half-width of an accuracy measured on ``n`` pairs at its widest (accuracy 0.5):
    ``1.96 * sqrt(0.25 / n)``, e.g. 0.098 for 100 pairs, 0.069 for 200."""
    return Z95 * 0.5 / math.sqrt(n)


def belongs_to_another_task(eval_source: str, train_source: str) -> bool:
    """True for a builtin evaluation set that does not measure ``train_source``'s task: a builtin
    held-out set with any other training data, or any builtin set with the user's own data."""
    return eval_source.startswith("builtin:") and BUILTIN_HELDOUT.get(eval_source) != train_source


@dataclass(frozen=True)
class EvalChoice:
    """Where the held-out pairs come from: ``source`` (a dataset to load) and the setting that named
    it (``given_by``: ``--eval-data`` or ``rm.eval_data``), or a split of the training data
    (``source`` None); ``ignored``: a builtin set the configuration named but that measures another task."""

    source: Optional[str]
    given_by: Optional[str]
    ignored: Optional[str] = None

    def ignored_note(self, train_source: str) -> Optional[str]:
        if self.ignored is None:
            return None
        return (f"rm.eval_data {self.ignored} is the builtin task's held-out set, not {train_source}'s: not used "
                "(--eval-data FILE evaluates on other pairs)")


def choose_eval_source(train_source: str, eval_arg: Optional[str], eval_config: Optional[str]) -> EvalChoice:
    """The held-out set of a stage trained on ``train_source``: ``--eval-data`` as given; else
    ``rm.eval_data`` unless it is a builtin set of another task; else a split of the training data."""
    if eval_arg:
        return EvalChoice(eval_arg, "--eval-data")
    if eval_config and not belongs_to_another_task(eval_config, train_source):
        return EvalChoice(eval_config, "rm.eval_data")
    return EvalChoice(None, None, ignored=eval_config or None)


def prompt_key(prompt: Any) -> str:
    """One string per distinct prompt (text or a message list)."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, ensure_ascii=False)


def split_by_prompt(keys: Sequence[str], fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """``(train, held out)`` indices of items whose prompts are ``keys``: whole prompts, drawn in a
    seeded order, go to the held-out side until it holds ``round(len(keys) * fraction)`` items (the
    last prompt drawn may take it past); the last prompt of the order always trains. Nothing is held
    out when ``fraction`` is 0 or there is one prompt."""
    groups: dict[str, list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    target = int(len(keys) * fraction + 0.5)
    order = list(groups)
    random.Random(seed).shuffle(order)
    held: list[int] = []
    for key in order[:-1]:
        if len(held) >= target:
            break
        held += groups[key]
    held_set = set(held)
    return [i for i in range(len(keys)) if i not in held_set], sorted(held)


def pairs_needed(fraction: float) -> Optional[int]:
    """Pairs whose ``fraction`` holds out :data:`MIN_HELDOUT` (None for fraction 0)."""
    return math.ceil(MIN_HELDOUT / fraction - 1e-9) if fraction > 0 else None


def too_small_note(n_pairs: int, n_held: int, fraction: float, source: str) -> str:
    """Why no held-out figure is reported for ``source``, and what would give one."""
    if fraction <= 0:
        return (f"data.eval_fraction is 0: no pair of {source} is held out, so there is no held-out figure "
                f"(training accuracy only); set data.eval_fraction or pass --eval-data for one")
    needed = pairs_needed(fraction)
    held = f"{n_held} held-out pair(s)" + (f" (+-{half_width(n_held):.2f} at 95%)" if n_held else "")
    advice = f"{needed} pairs ({needed - n_pairs} more) would hold out {MIN_HELDOUT} (+-{half_width(MIN_HELDOUT):.2f})"
    # Or a larger fraction of these pairs, while at least as many stay to train on.
    wider = math.ceil(100 * MIN_HELDOUT / n_pairs) / 100 if n_pairs else 1.0
    if wider <= 0.5:
        advice += f", or set data.eval_fraction={wider:g}"
    return (f"{n_pairs} pairs of {source} at data.eval_fraction {fraction:g} give {held}: too few for a "
            f"held-out figure (training accuracy only); {advice}, or pass --eval-data FILE")

"""The data of ``homerlhf dpo`` and ``homerlhf kto``: loaded, checked, split, tokenised, before any weight.

DPO trains on preference pairs (:func:`homerlhf.data.load.load_preferences`: every pairs format the
data layer reads, the app's ``preferences.jsonl`` among them). KTO trains on rated answers
(:func:`homerlhf.data.ratings.load_rated`: a ratings file, or pairs as one good and one bad answer
each). Several sources are joined. The held-out rows are ``--eval-data``, else a
``data.eval_fraction`` split (seeded) of the sources' units (pairs, or rated answers) by prompt, as the
reward stage splits its pairs (:func:`homerlhf.data.heldout.split_by_prompt`): every unit of one prompt
on the same side, so the held-out figures measure prompts the run never trained on.

Token ids are the ones PPO samples and scores (:class:`homerlhf.data.replies.ReplyEncoder`): the
prompt rendered with its generation prompt, the answer as the model writes it, the end-of-turn token,
nothing after it. A row longer than ``max_len`` keeps its answers whole and the head of its prompt's
last user message (:func:`homerlhf.data.tokens.fit_prompt`), or is dropped with ``data.overlong=drop``
or when even an emptied prompt leaves no room.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from homerlhf.data.heldout import prompt_key, split_by_prompt
from homerlhf.data.load import LoadReport, load_preferences
from homerlhf.data.ratings import load_rated
from homerlhf.data.replies import ReplyEncoder
from homerlhf.data.tokens import fit_prompt
from homerlhf.errors import UserError

METHODS = ("dpo", "kto")


@dataclass
class PreferenceData:
    """Training rows in TRL's tokenised columns, and the held-out pairs and rated answers."""

    method: str
    train: list[dict[str, Any]]  # dpo: prompt_ids/chosen_ids/rejected_ids; kto: prompt_ids/completion_ids/label
    eval_pairs: list[dict[str, Any]] = field(default_factory=list)  # prompt_ids/chosen_ids/rejected_ids
    eval_rated: list[dict[str, Any]] = field(default_factory=list)  # prompt_ids/completion_ids/label
    reports: list[LoadReport] = field(default_factory=list)

    def fingerprint(self) -> str:
        """sha256 of the training rows: a resumed run refuses data that changed since it started."""
        return hashlib.sha256(json.dumps(self.train, sort_keys=True).encode()).hexdigest()

    def counts(self) -> dict[str, int]:
        n_good = sum(1 for r in self.train if r.get("label") is True)
        extra = {"n_good": n_good, "n_bad": len(self.train) - n_good} if self.method == "kto" else {}
        return {"n_train": len(self.train), "n_eval_pairs": len(self.eval_pairs),
                "n_eval_rated": len(self.eval_rated), **extra}


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def fit_answers(encoder: ReplyEncoder, prompt, answers, max_len: int, overlong: str,
                report: LoadReport) -> Optional[tuple[list[int], list[list[int]]]]:
    """``(prompt ids, [answer ids, ...])`` of one row, at most ``max_len`` tokens each with the prompt;
    None for a row dropped as too long (counted in ``report``)."""
    head = encoder.prompt_ids(prompt)
    full = [encoder.sequence_ids(prompt, answer) for answer in answers]
    n = min([len(head)] + [_common_prefix(head, ids) for ids in full])  # where every answer leaves the prompt
    tails = [ids[n:] for ids in full]
    longest = max(len(t) for t in tails)
    if n + longest <= max_len:
        return head[:n], tails
    fitted = None
    if overlong == "truncate" and n == len(head):
        fitted = fit_prompt(encoder.tokenizer, prompt, max_len - longest)
    if fitted is None:
        report.n_dropped += 1
        return None
    report.n_truncated += 1
    return fitted, tails


def _unit_prompt(unit: dict):
    return (unit["pair"] if "pair" in unit else unit["rated"])["prompt"]


def _split(units: list, fraction: float, seed: int) -> tuple[list, list]:
    """(train, eval): whole prompts held out (:func:`homerlhf.data.heldout.split_by_prompt`, about
    ``fraction`` of the units), the training units in the order of a seeded shuffle (the order
    they train in; with ``fraction`` 0, every unit in that order)."""
    _, held = split_by_prompt([prompt_key(_unit_prompt(u)) for u in units], fraction, seed)
    order = list(range(len(units)))
    random.Random(seed).shuffle(order)
    held_set = set(held)
    return [units[i] for i in order if i not in held_set], [units[i] for i in held]


def _load(method: str, sources: Sequence[str], data_cfg) -> tuple[list[dict], list[LoadReport]]:
    """Units of every source: pairs (dpo), or rated answers grouped per pair (kto: a pair stays one unit,
    so a split never puts its good answer in training and its bad one in the held-out rows)."""
    units, reports = [], []
    for source in sources:
        if method == "dpo":
            records, report = load_preferences(source, data_cfg)
            units += [{"pair": r} for r in records]
        else:
            rated, report, pairs = load_rated(source, data_cfg)
            units += [{"pair": p} for p in pairs] if pairs is not None else [{"rated": r} for r in rated]
        reports.append(report)
    return units, reports


def _unit_rows(method: str, unit: dict, encoder: ReplyEncoder, max_len: int, overlong: str,
               report: LoadReport) -> tuple[list[dict], Optional[dict]]:
    """(training rows, held-out pair or None) of one unit, fitted to ``max_len``."""
    if "pair" in unit:
        pair = unit["pair"]
        fitted = fit_answers(encoder, pair["prompt"], [pair["chosen"], pair["rejected"]], max_len, overlong, report)
        if fitted is None:
            return [], None
        prompt, (chosen, rejected) = fitted
        as_pair = {"prompt_ids": prompt, "chosen_ids": chosen, "rejected_ids": rejected}
        if method == "dpo":
            return [as_pair], as_pair
        return [{"prompt_ids": prompt, "completion_ids": chosen, "label": True},
                {"prompt_ids": prompt, "completion_ids": rejected, "label": False}], as_pair
    rated = unit["rated"]
    fitted = fit_answers(encoder, rated["prompt"], [rated["completion"]], max_len, overlong, report)
    if fitted is None:
        return [], None
    return [{"prompt_ids": fitted[0], "completion_ids": fitted[1][0], "label": rated["label"]}], None


def _rows(method: str, units: list[dict], tokenizer, max_len: int, overlong: str, report: LoadReport):
    encoder = ReplyEncoder(tokenizer)
    rows, pairs = [], []
    for unit in units:
        unit_rows, pair = _unit_rows(method, unit, encoder, max_len, overlong, report)
        rows += unit_rows
        pairs += [pair] if pair is not None else []
    return rows, pairs


def load_units(method: str, sources: Sequence[str], eval_source: Optional[str], cfg) -> tuple[list, list, list]:
    """``(train units, eval units, reports)``: the rows read and checked, no tokenizer needed."""
    section = getattr(cfg, method)
    units, reports = _load(method, sources, cfg.data)
    if eval_source:
        train, _ = _split(units, 0.0, cfg.seed)  # shuffled the same way
        held, eval_reports = _load(method, [eval_source], cfg.data)
        reports += eval_reports
    else:
        train, held = _split(units, cfg.data.eval_fraction, cfg.seed)
    check_enough(method, train, section.min_rows, sources, reports)
    return train, held, reports


def check_enough(method: str, train_units: list[dict], min_rows: int, sources: Sequence[str],
                 reports: Sequence[LoadReport]) -> None:
    """Too few rows to train on is one line saying how many there are and how many are needed."""
    n = sum(2 if method == "kto" and "pair" in u else 1 for u in train_units)
    if n >= min_rows:
        return
    what = "preference pairs" if method == "dpo" else "rated answers (a pair counts as two)"
    bad = sum(r.n_bad for r in reports)
    found = f"{n} usable for training" + (f" ({bad} bad rows)" if bad else "") + " after the held-out split"
    raise UserError(f"{method} needs at least {min_rows} {what}; {', '.join(sources)} gave {found}: "
                    f"collect more, or lower {method}.min_rows (or data.eval_fraction)")


def tokenise(method: str, train_units: list, eval_units: list, reports: list[LoadReport], tokenizer,
             cfg) -> PreferenceData:
    """The units as token rows fitted to ``max_len`` (over-long rows counted in the first report)."""
    section = getattr(cfg, method)
    report = reports[0]
    train, _ = _rows(method, train_units, tokenizer, section.max_len, cfg.data.overlong, report)
    if not train:
        raise UserError(f"no training row of {report.source} fits {method}.max_len={section.max_len} tokens "
                        f"(data.overlong={cfg.data.overlong}): raise {method}.max_len or shorten the prompts")
    check_enough(method, [{"rated": r} for r in train], section.min_rows, [r.source for r in reports], reports)
    if method == "kto":  # a pair's two answers apart: KTO's KL term pairs each prompt with a neighbour's answer
        random.Random(cfg.seed).shuffle(train)
    rated, pairs = _rows("kto", eval_units, tokenizer, section.max_len, cfg.data.overlong, report)
    return PreferenceData(method, train, eval_pairs=pairs, eval_rated=rated, reports=list(reports))


def kl_completions(rows: list[dict], batch_size: int) -> list[list[int]]:
    """KTO's mismatched completions for its KL estimate, as TRL builds them: within each consecutive
    batch the completions rotated by one, ``(x_1, y_n), (x_2, y_1), ..., (x_n, y_{n-1})``."""
    out: list[list[int]] = []
    for start in range(0, len(rows), batch_size):
        batch = [r["completion_ids"] for r in rows[start:start + batch_size]]
        out += [batch[-1]] + batch[:-1]
    return out

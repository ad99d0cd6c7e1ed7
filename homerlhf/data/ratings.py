"""Rated answers for KTO: one answer to one prompt, rated good (thumbs up) or bad (thumbs down).

A ratings file has one row per rated answer::

    {"prompt": "How do I water a fern?", "completion": "Keep its soil moist ...", "label": true}

- the prompt: ``prompt`` (text or a message list), ``question``, ``instruction`` (+ ``input``), or a
  ``messages`` / ``conversations`` list (its trailing assistant turns dropped);
- the answer: ``completion``, ``response``, ``answer`` or ``output`` (text, a message or messages);
- the rating: ``label``, ``rating`` or ``thumbs`` (:func:`parse_label` lists the values).

Other columns are kept out of training. ``RUN_DIR/ratings.jsonl`` (:data:`RATINGS_FILE`) is where the
app's thumbs go. A preference pair counts as two rated answers (:func:`load_rated`), so the app's
``preferences.jsonl`` and any pairs dataset train KTO as they are.
"""

from __future__ import annotations

from typing import Any, Optional

from homerlhf.data.formats import BadRow, Columns, _as_messages, _find, prompt_converter
from homerlhf.data.load import LoadReport, load_records
from homerlhf.data.read import read_rows
from homerlhf.errors import UserError

RATINGS_FILE = "ratings.jsonl"
ANSWER_COLUMNS = ("completion", "response", "answer", "output")
LABEL_COLUMNS = ("label", "rating", "thumbs")
GOOD = {"true", "1", "+1", "up", "good", "desirable", "thumbs_up", "yes"}
BAD = {"false", "0", "-1", "down", "bad", "undesirable", "thumbs_down", "no"}


def parse_label(value: Any) -> bool:
    """A rating as True (good) or False (bad): ``true`` / ``false``, ``1`` / ``0`` / ``-1``, ``"up"`` /
    ``"down"``, ``"good"`` / ``"bad"``, ``"desirable"`` / ``"undesirable"``; :class:`BadRow` for anything else."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (1, 0, -1):
        return value == 1
    if isinstance(value, str) and value.strip().lower() in GOOD | BAD:
        return value.strip().lower() in GOOD
    raise BadRow(f"label {value!r} is not a rating; use true/false, 1/0/-1, up/down or good/bad")


def is_rated(columns) -> bool:
    """Whether rows with these columns are rated answers (an answer and a rating column)."""
    return _find(columns, *ANSWER_COLUMNS) is not None and _find(columns, *LABEL_COLUMNS) is not None


def _converter(columns: list[str], cols: Columns):
    answer, label = _find(columns, *ANSWER_COLUMNS), _find(columns, *LABEL_COLUMNS)
    if answer is None or label is None:
        raise UserError(f"no answer and rating columns among {sorted(columns)}; a rated answer has a prompt, "
                        f"one of {'/'.join(ANSWER_COLUMNS)} and one of {'/'.join(LABEL_COLUMNS)} (or give "
                        "preference pairs: chosen/rejected)")
    fmt, to_prompt = prompt_converter([c for c in columns if c not in (answer, label)], cols)

    def convert(row: dict) -> dict[str, Any]:
        completion = _as_messages(row.get(answer), answer, "assistant")
        if completion[-1]["role"] != "assistant":
            raise BadRow(f"{answer} must end with an assistant reply")
        return {"prompt": to_prompt(row), "completion": completion, "label": parse_label(row.get(label))}

    return f"rated answers ({fmt}/{answer}/{label})", convert


def _load_rated_rows(source: str, data_cfg) -> tuple[list[dict], LoadReport]:
    split = data_cfg.split if data_cfg is not None else "train"
    max_rows = data_cfg.max_rows if data_cfg is not None else None
    rows = read_rows(source, split=split, max_rows=max_rows)
    report = LoadReport(source=source, kind="rated", n_rows=len(rows))
    columns = sorted({k for r in rows for k in r if not k.startswith("__")})
    if not columns:
        raise UserError(f"{source} has no rows; check the file or split")
    cols = Columns.from_config(data_cfg) if data_cfg is not None else Columns()
    file_wide = _converter(columns, cols)  # a file of no rated-answer format: its one-line refusal
    by_columns: dict[tuple, tuple] = {}

    def converter(row: dict) -> tuple:
        """The row's own format (the columns it fills), else the file's (which names its missing field)."""
        key = tuple(sorted(k for k, v in row.items() if not k.startswith("__") and v is not None))
        if key not in by_columns:
            try:
                by_columns[key] = _converter(list(key), cols)
            except UserError:
                by_columns[key] = file_wide
        return by_columns[key]

    records, formats = [], {}
    for i, row in enumerate(rows):
        try:
            if "__bad__" in row:
                raise BadRow(row["__bad__"])
            fmt, convert = converter(row)
            formats[fmt] = None
            records.append(convert(row))
        except BadRow as exc:
            report.add_bad(i, str(exc), row.get("__line__", row))
    report.n_usable, report.format = len(records), " + ".join(formats) or file_wide[0]
    if not records:
        first = report.bad_examples[0]["reason"] if report.bad_examples else "no rows"
        raise UserError(f"no usable rows in {source} ({report.n_bad} bad; first: {first}); check the format")
    return records, report


def _columns_of(source: str, data_cfg) -> list[str]:
    split = data_cfg.split if data_cfg is not None else "train"
    rows = read_rows(source, split=split, max_rows=1)
    return sorted({k for r in rows for k in r if not k.startswith("__")})


def load_rated(source: str, data_cfg=None) -> tuple[list[dict[str, Any]], LoadReport, Optional[list[dict]]]:
    """``(rated answers, report, pairs)`` of ``source``: a ratings file's rows as they are, or each
    preference pair as its chosen answer (good) and its rejected one (bad); ``pairs`` are the pair
    records (None for ratings), kept for the held-out margin."""
    columns = [] if source.startswith("builtin:") else _columns_of(source, data_cfg)
    if not columns or not is_rated(columns):
        if columns and not {"chosen", "rejected"} <= set(columns) and not (data_cfg and data_cfg.chosen_column):
            _converter(columns, Columns())  # neither ratings nor pairs: its one-line refusal
        pairs, report = load_records(source, "preference", data_cfg)
        rated = [{"prompt": p["prompt"], "completion": p[side], "label": side == "chosen"}
                 for p in pairs for side in ("chosen", "rejected")]
        return rated, report, pairs
    rated, report = _load_rated_rows(source, data_cfg)
    return rated, report, None

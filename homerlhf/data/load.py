"""Loading datasets in the formats people have and normalising them to three record kinds.

``load_records(source, kind, cfg.data)`` reads raw rows (:mod:`homerlhf.data.read`: a builtin
name, a local file or a hub id), converts each with the converter its columns call for
(:mod:`homerlhf.data.formats`; detected per row, so a file mixing ``prompt``, ``instruction`` +
``input`` and ``messages`` rows keeps them all) and returns the records with a :class:`LoadReport`. Rows that
cannot be used (missing field, wrong type, empty text, chosen == rejected) are counted in the
report with the first few shown; no usable row at all is a one-line UserError. Tokenising the
records is :mod:`homerlhf.data.tokens`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from homerlhf.data.formats import (
    BadRow,
    Columns,
    Record,
    preference_converter,
    prompt_converter,
    sft_converter,
)
from homerlhf.data.read import read_rows
from homerlhf.errors import UserError

Kind = Literal["prompt", "sft", "preference"]
MAX_BAD_EXAMPLES = 5


@dataclass
class LoadReport:
    """What loading found; the CLI prints ``summary()`` and the Gradio app shows the fields."""

    source: str
    kind: str
    format: str = "unknown"
    n_rows: int = 0
    n_usable: int = 0
    n_bad: int = 0
    bad_examples: list[dict[str, Any]] = field(default_factory=list)  # {"row", "reason", "value"}
    bad_reasons: dict[str, int] = field(default_factory=dict)  # every bad row counted under its reason
    n_truncated: int = 0
    n_dropped: int = 0  # over-long rows dropped (cfg.data.overlong == "drop")

    def add_bad(self, row: int, reason: str, value: Any) -> None:
        self.n_bad += 1
        self.bad_reasons[reason] = self.bad_reasons.get(reason, 0) + 1
        if len(self.bad_examples) < MAX_BAD_EXAMPLES:
            text = value if isinstance(value, str) else json.dumps(value, default=str)
            self.bad_examples.append({"row": row, "reason": reason, "value": text[:160]})

    def summary(self) -> str:
        lines = [
            f"{self.source}: {self.format} ({self.kind}), {self.n_rows} rows, {self.n_usable} usable, "
            f"{self.n_bad} bad, {self.n_truncated} truncated, {self.n_dropped} dropped as too long"
        ]
        if self.bad_reasons:
            counts = sorted(self.bad_reasons.items(), key=lambda kv: (-kv[1], kv[0]))
            lines.append("  bad rows by reason: " + ", ".join(f"{reason} {n}" for reason, n in counts))
        lines += [f"  row {b['row']}: {b['reason']}: {b['value']}" for b in self.bad_examples]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return asdict(self)


def _converter(kind: Kind, columns: list[str], cols: Columns):
    """(format name, row -> record) for rows with these ``columns``."""
    if kind == "prompt":
        fmt, fn = prompt_converter(columns, cols)
        return fmt, lambda row: {"prompt": fn(row)}
    if kind == "sft":
        return sft_converter(columns, cols)
    if kind == "preference":
        return preference_converter(columns, cols)
    raise ValueError(f"unknown record kind {kind!r}")


def _row_converters(rows: list[dict[str, Any]], kind: Kind, cols: Columns) -> list:
    """One (format, convert) per row, chosen from the columns that row fills (readers give every
    row every column of the file, ``None`` where absent); a row that fits no format alone gets the
    file-wide one (it then reports its own missing field), else the UserError saying why. A
    UserError is raised only when no row fits any format."""

    def pick(columns: tuple[str, ...]):
        try:
            return _converter(kind, list(columns), cols)
        except UserError as exc:
            return exc

    file_wide = pick(tuple(sorted({k for r in rows for k in r if not k.startswith("__")})))
    by_columns: dict[tuple[str, ...], Any] = {}
    picked = []
    for row in rows:
        if "__bad__" in row:  # unreadable: counted by the caller
            picked.append(None)
            continue
        key = tuple(sorted(k for k, v in row.items() if not k.startswith("__") and v is not None))
        if key not in by_columns:
            own = pick(key)
            by_columns[key] = file_wide if isinstance(own, UserError) else own
        picked.append(by_columns[key])
    if not any(isinstance(c, tuple) for c in picked):
        raise file_wide if isinstance(file_wide, UserError) else next(c for c in picked if c is not None)
    return picked


def normalise(rows: list[dict[str, Any]], kind: Kind, cols: Columns = Columns(), source: str = "rows",
              keep_rows: bool = False, prompts_from_pairs: bool = False) -> tuple[list[Record], LoadReport]:
    """Raw rows -> normalised records of ``kind`` and the report of what was dropped and why.

    ``keep_rows``: each record also holds its raw row, every column, under ``"row"`` (what a
    reward function sees of the dataset, e.g. a reference answer). ``prompts_from_pairs``: preference
    pairs loaded as prompts keep their prompts; otherwise they are refused, a likely mix-up of files."""
    report = LoadReport(source=source, kind=kind, n_rows=len(rows))
    columns = {k for r in rows for k, v in r.items() if not k.startswith("__") and v is not None}
    if not rows or not columns:
        raise UserError(f"{source} has no rows; check the file or split")
    if kind == "prompt" and {"chosen", "rejected"} <= columns and not prompts_from_pairs and not cols.prompt:
        raise UserError(f"{source} holds preference pairs (chosen, rejected), not prompts: give it to `homerlhf reward` "
                        "(or dpo, kto) and `train --data` a prompts file; to train on the pairs' prompts, set "
                        "data.prompts_from_pairs=true")
    if kind not in ("prompt", "sft", "preference"):
        raise ValueError(f"unknown record kind {kind!r}")
    converters = _row_converters(rows, kind, cols)
    formats = list(dict.fromkeys(c[0] for c in converters if isinstance(c, tuple)))
    report.format = " + ".join(formats)
    records = []
    for i, row in enumerate(rows):
        try:
            if "__bad__" in row:
                raise BadRow(row["__bad__"])
            if isinstance(converters[i], UserError):
                raise BadRow(str(converters[i]))
            record = converters[i][1](row)
            if kind == "preference" and record["chosen"] == record["rejected"]:
                raise BadRow("chosen == rejected")
            if keep_rows:
                record["row"] = {k: v for k, v in row.items() if not k.startswith("__")}
        except BadRow as exc:
            report.add_bad(i, str(exc), row.get("__line__", row))
            continue
        records.append(record)
    report.n_usable = len(records)
    if not records:
        first = report.bad_examples[0]["reason"] if report.bad_examples else "no rows"
        raise UserError(f"no usable rows in {source} ({report.n_bad} bad; first: {first}); check the format or data.*_column")
    return records, report


def load_records(source: str, kind: Kind, data_cfg=None, keep_rows: bool = False) -> tuple[list[Record], LoadReport]:
    """Read ``source`` and normalise it to ``kind`` records; ``data_cfg`` is a ``DataConfig``;
    ``keep_rows``: see :func:`normalise`."""
    split = data_cfg.split if data_cfg is not None else "train"
    max_rows = data_cfg.max_rows if data_cfg is not None else None
    cols = Columns.from_config(data_cfg) if data_cfg is not None else Columns()
    rows = read_rows(source, split=split, max_rows=max_rows)
    pairs = bool(data_cfg is not None and data_cfg.prompts_from_pairs)
    return normalise(rows, kind, cols, source=source, keep_rows=keep_rows, prompts_from_pairs=pairs)


def load_prompts(source: str, data_cfg=None, keep_rows: bool = False):
    return load_records(source, "prompt", data_cfg, keep_rows=keep_rows)


def load_sft(source: str, data_cfg=None):
    return load_records(source, "sft", data_cfg)


def load_preferences(source: str, data_cfg=None):
    return load_records(source, "preference", data_cfg)

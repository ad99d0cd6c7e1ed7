"""The Data tab: pick a builtin dataset, a hub id or an uploaded file; see what the loader made of it.

Loading and normalising is :mod:`homerlhf.data.load`; this tab only shows its ``LoadReport``, a
length histogram and a few normalised records, and hands the chosen source to the run config.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Optional

from homerlhf.app.common import guarded, set_override
from homerlhf.errors import UserError

KINDS = {"prompts (PPO)": "prompt", "prompt/completion (SFT)": "sft", "preferences (reward model)": "preference"}
# The config key each kind of dataset goes into.
KIND_KEYS = {"prompt": "data.prompts", "sft": "sft.data", "preference": "rm.data"}
N_SHOWN = 5


def builtin_names() -> list[str]:
    from homerlhf.data.read import BUILTIN

    return list(BUILTIN)


def default_kind(source: str) -> str:
    if "pairs" in source:
        return "preference"
    if source.endswith("-sft"):
        return "sft"
    return "prompt"


def uploads_dir() -> Path:
    from homerlhf.paths import cache_dir

    return cache_dir("app", "uploads")


def keep_upload(path: str) -> str:
    """Copy a Gradio upload (a temp file that Gradio may delete) to the app's uploads folder."""
    src = Path(path)
    dest = uploads_dir() / src.name
    shutil.copyfile(src, dest)
    return str(dest)


def _text_of(messages) -> str:
    if isinstance(messages, list):
        return "\n".join(f"{m.get('role', '?')}: {m.get('content', '')}" for m in messages)
    return str(messages)


def record_lengths(records: list[dict]) -> dict[str, list[int]]:
    """Characters per field (prompt, completion/chosen/rejected), summed over the field's messages."""
    out: dict[str, list[int]] = {}
    for record in records:
        for name, messages in record.items():
            n = sum(len(m.get("content", "")) for m in messages) if isinstance(messages, list) else len(str(messages))
            out.setdefault(name, []).append(n)
    return out


def length_figure(lengths: dict[str, list[int]]):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 3), layout="constrained")
    ax = fig.subplots()
    for name, values in lengths.items():
        ax.hist(values, bins=30, alpha=0.6, label=f"{name} (n={len(values)})")
    ax.set_xlabel("length (characters)")
    ax.set_ylabel("rows")
    ax.set_title("Length per field")
    ax.legend(fontsize=8)
    return fig


def report_markdown(report) -> str:
    lines = [
        f"**Source:** `{report.source}`  ",
        f"**Detected format:** {report.format} → {report.kind} records  ",
        f"**Rows:** {report.n_rows} · **usable:** {report.n_usable} · **bad:** {report.n_bad}"
        f" · truncated: {report.n_truncated} · dropped as too long: {report.n_dropped}",
    ]
    if report.n_bad and not report.bad_examples:
        lines.append("(no examples of bad rows kept)")
    return "\n".join(lines)


def row_places(source: str):
    """Row index (the loader's, from 0) -> where a person finds the row: ``line N`` of a local JSON-lines or
    CSV file, counted from 1 as editors count (blank lines, which the readers skip, counted too; a CSV
    row where its record starts), else ``row N`` from 1."""
    path = Path(source)
    starts: list[int] = []
    if path.suffix.lower() in (".jsonl", ".json") and path.is_file():
        text = path.read_text(encoding="utf-8", errors="replace")
        if not text.lstrip().startswith("["):  # a JSON array has rows, not lines
            starts = [n for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    elif path.suffix.lower() == ".csv" and path.is_file():
        import csv

        with open(path, newline="", encoding="utf-8", errors="replace") as fh:
            reader, before = csv.reader(fh), 0
            for record in reader:
                start, before = before + 1, reader.line_num
                if record:
                    starts.append(start)
        starts = starts[1:]  # the header
    return lambda i: f"line {starts[i]}" if i < len(starts) else f"row {i + 1}"


def bad_rows_table(report, places=None) -> list[list]:
    """The first bad rows: where (``line N`` / ``row N``, :func:`row_places`), why (in this tab's words), what."""
    places = places or row_places(report.source)
    return [[places(b["row"]), app_words(b["reason"]), b["value"]] for b in report.bad_examples]


# The loader's config keys as this tab's fields; the data keys it has no field for go to the Plan tab.
COLUMN_FIELDS = {"prompt_column": "Prompt column", "chosen_column": "Reply / chosen column",
                 "rejected_column": "Rejected column", "messages_column": "Messages column"}
OWN_FIELDS = {"split": "Split", "max_rows": "Max rows", **COLUMN_FIELDS}


def app_words(message: str) -> str:
    """A loader message in this tab's words: ``data.prompt_column`` is its *Prompt column* field (under
    *Column names*), and a ``data.*`` key it has no field for is said to go in the Plan tab's overrides."""
    from homerlhf.config.schema import DataConfig

    named = any(f"data.{name}" in message for name in COLUMN_FIELDS) or "data.*_column" in message
    message = re.sub(r"\bset (data\.\w+_column)", r"fill \1", message)
    message = message.replace("data.*_column", "the 'Column names' fields")
    for name in DataConfig.model_fields:
        where = f"'{OWN_FIELDS[name]}'" if name in OWN_FIELDS else rf"data.{name}\1 (in the Plan tab's overrides)"
        message = re.sub(rf"\bdata\.{name}\b(=[^\s;,)]+)?", where, message)
    return message + (" (under 'Column names')" if named and "'Column names'" not in message else "")


def sample_table(records: list[dict], n: int = N_SHOWN) -> list[list]:
    rows = []
    for record in records[:n]:
        rows.append([_text_of(record.get("prompt")), _text_of(next((record[k] for k in ("completion", "chosen") if k in record), "")),
                     _text_of(record.get("rejected", ""))])
    return rows


def resolve_source(mode: str, builtin: Optional[str], hub_id: str, upload: Optional[str]) -> str:
    if mode == "builtin":
        if not builtin:
            raise UserError("pick a builtin dataset")
        return builtin
    if mode == "hub id":
        if not (hub_id or "").strip():
            raise UserError("type a hub dataset id, e.g. trl-lib/ultrafeedback_binarized")
        return hub_id.strip()
    if not upload:
        raise UserError("upload a .jsonl, .json, .csv or .parquet file first")
    return keep_upload(upload)


def column_items(columns) -> list[tuple[str, str]]:
    """(``data.<name>_column``, value) of the *Column names* boxes filled, in :data:`COLUMN_FIELDS` order."""
    return [(f"data.{name}", value.strip()) for name, value in zip(COLUMN_FIELDS, columns) if (value or "").strip()]


def load_for_ui(source: str, kind: str, split: str = "train", max_rows: Optional[int] = None, columns=()):
    """(records, report) through the project's loader, with this tab's split, row cap and column names;
    a loader error is said in this tab's words (:func:`app_words`)."""
    from homerlhf.config.schema import DataConfig
    from homerlhf.data.load import load_records

    named = {key.removeprefix("data."): value for key, value in column_items(columns)}
    if max_rows is not None and (max_rows < 0 or float(max_rows) != int(max_rows)):
        raise UserError(f"'Max rows' is {max_rows:g}: give 0 (all rows) or a whole number of rows to keep, e.g. 500")
    cfg = DataConfig(split=split or "train", max_rows=int(max_rows) if max_rows else None, **named)
    try:
        return load_records(source, kind, cfg)
    except UserError as exc:
        raise UserError(app_words(str(exc))) from None


def load_screen(mode, builtin, hub_id, upload, kind_label, split, max_rows, *columns, source: Optional[str] = None) -> tuple:
    """Load what the tab shows: (report, histogram, bad rows, samples, the loaded [source, kind, split,
    max rows, *column names])."""
    source = source or resolve_source(mode, builtin, hub_id, upload)
    records, report = load_for_ui(source, KINDS[kind_label], split, max_rows, columns)
    return (report_markdown(report), length_figure(record_lengths(records)), bad_rows_table(report),
            sample_table(records), [source, kind_label, split, max_rows, *columns])


def use_screen(screen: list, loaded, overrides: str) -> tuple:
    """*Use for training*: what is on screen into the overrides, loaded first when it is not what was
    loaded: (message, overrides, *the shown outputs, or updates that keep them)."""
    import gradio as gr

    mode, builtin, hub_id, upload, kind_label, split, max_rows, *columns = screen
    source = resolve_source(mode, builtin, hub_id, upload)
    outs = tuple(gr.update() for _ in range(5))
    if loaded != [source, kind_label, split, max_rows, *columns]:
        outs = load_screen(mode, builtin, hub_id, upload, kind_label, split, max_rows, *columns, source=source)
    items = [(KIND_KEYS[KINDS[kind_label]], source), *column_items(columns)]
    for key, value in items:
        overrides = set_override(overrides, key, value)
    return (f"Set {' '.join(f'`{k}={v}`' for k, v in items)} in the Plan tab's overrides.", overrides, *outs)


def reward_check(spec: str, source: str, split: str = "train"):
    """The reward function on the chosen dataset's first raw rows (:func:`homerlhf.app.rewards.check_table`)."""
    from homerlhf.app.rewards import N_CHECKED, check_table
    from homerlhf.data.read import read_rows

    if not source:
        raise UserError("load a dataset first (Load and inspect)")
    return check_table(spec, read_rows(source, split or "train", max_rows=N_CHECKED))


def _layout() -> dict:
    """The tab's components by name (the Source inputs, Column names, buttons and results)."""
    import gradio as gr

    c = {}
    with gr.Row():
        c["mode"] = gr.Radio(["builtin", "hub id", "upload"], value="builtin", label="Source", elem_id="data-mode")
        c["kind_label"] = gr.Dropdown(list(KINDS), value="prompts (PPO)", label="Use as", elem_id="data-kind")
    with gr.Row():  # only the input of the Source picked is shown
        c["builtin"] = gr.Dropdown(builtin_names(), value="builtin:demo", label="Builtin dataset", elem_id="data-builtin")
        c["hub_id"] = gr.Textbox(label="Hub dataset id", placeholder="org/name", visible=False, elem_id="data-hub")
        c["split"] = gr.Textbox("train", label="Split", elem_id="data-split")
        c["max_rows"] = gr.Number(0, label="Max rows (0: all)", precision=0, elem_id="data-max-rows")
    c["upload"] = gr.File(label="Upload .jsonl / .json / .csv / .parquet", file_types=[".jsonl", ".json", ".csv", ".parquet"],
                          type="filepath", visible=False, elem_id="data-upload")
    with gr.Accordion("Column names (empty: detected; Use for training writes the ones filled as data.*_column)",
                      open=False, elem_id="data-columns"):
        with gr.Row():
            c["columns"] = [gr.Textbox(label=label, elem_id=f"data-col-{name.split('_')[0]}")
                            for name, label in COLUMN_FIELDS.items()]
    with gr.Row():
        c["load_btn"] = gr.Button("Load and inspect", variant="primary", elem_id="data-load")
        c["use_btn"] = gr.Button("Use for training", elem_id="data-use")
    c["message"] = gr.Markdown(elem_id="data-message")
    c["report_md"] = gr.Markdown(elem_id="data-report")
    with gr.Row():
        c["hist"] = gr.Plot(label="Length histogram", elem_id="data-hist")
        c["bad"] = gr.Dataframe(headers=["where", "reason", "value"], label="Bad rows (first few)", wrap=True,
                                interactive=False, elem_id="data-bad")
    c["samples"] = gr.Dataframe(headers=["prompt", "reply / chosen", "rejected"], label=f"First {N_SHOWN} normalised records",
                                wrap=True, interactive=False, elem_id="data-samples")
    c["chosen_source"] = gr.State("")  # the source last loaded, as (source, kind, split, max rows, *columns)
    return c


# A load or Use that fails leaves none of the previous load's results under its error.
CLEARED = {"report": "", "hist": None, "bad": None, "samples": None, "loaded": ""}


def build(overrides_box, reward_function=None) -> dict:
    """Lay out the tab inside the current ``gr.Blocks``; ``overrides_box`` and ``reward_function`` are
    the Plan tab's. Returns the components the page keeps across reloads, by name."""
    import gradio as gr

    gr.Markdown("### Dataset\nPick a builtin dataset, type a hub id, or upload a file. "
                "The loader detects the format and shows what it kept and why it dropped rows.")
    c = _layout()

    def on_builtin(name):
        kind = default_kind(name or "")
        return next(label for label, k in KINDS.items() if k == kind)

    c["builtin"].change(on_builtin, c["builtin"], c["kind_label"])
    # Another source: only its input shows, and no message of the last one's load stays.
    c["mode"].change(lambda m: (*(gr.update(visible=m == name) for name in ("builtin", "hub id", "upload")), ""),
                     c["mode"], [c["builtin"], c["hub_id"], c["upload"], c["message"]])
    screen = [c[k] for k in ("mode", "builtin", "hub_id", "upload", "kind_label", "split", "max_rows")] + c["columns"]
    shown = [c["report_md"], c["hist"], c["bad"], c["samples"], c["chosen_source"]]
    cleared = list(CLEARED.values())

    @guarded(6, error_index=0, on_error={i + 1: v for i, v in enumerate(cleared)})
    def on_load(*values):
        return ("", *load_screen(*values))

    c["load_btn"].click(on_load, screen, [c["message"], *shown])

    @guarded(7, error_index=0, on_error={i + 2: v for i, v in enumerate(cleared)})
    def on_use(*values):
        """What is on screen goes into the overrides (loaded first when it is not what was loaded)."""
        return use_screen(list(values[:-2]), values[-2], values[-1])

    c["use_btn"].click(on_use, [*screen, c["chosen_source"], overrides_box], [c["message"], overrides_box, *shown])
    if reward_function is not None:
        _reward_check_section(reward_function, c["chosen_source"], c["split"])
    return {f"data_{name}": c[name] for name in PERSISTED} | {f"data_column_{i}": box for i, box in enumerate(c["columns"])}


# The tab's choices the page keeps across reloads (homerlhf.app.page_settings).
PERSISTED = ("mode", "builtin", "hub_id", "upload", "kind_label", "split", "max_rows")


def _reward_check_section(reward_function, chosen_source, split) -> None:
    import gradio as gr

    gr.Markdown("#### Reward function on these rows\nThe Plan tab's reward function scores each row's own "
                "`answer` (when the dataset has one) and an empty reply: a right answer should score high.")
    check_btn = gr.Button("Check reward function", elem_id="data-reward-check")
    message = gr.Markdown(elem_id="data-reward-message")  # under its button, not at the top of the tab
    checked = gr.Dataframe(headers=["prompt", "answer", "reward(answer)", "reward(empty)"], wrap=True,
                           interactive=False, elem_id="data-reward-table")

    @guarded(2, error_index=0)
    def on_check(spec, loaded, split):
        if not (spec or "").strip():  # the box's empty choice: the preset's reward model, no function
            return NO_FUNCTION, []
        return "", reward_check(spec, loaded[0] if loaded else "", split)

    check_btn.click(on_check, [reward_function, chosen_source, split], [message, checked])


NO_FUNCTION = ("The run's reward is **the preset's reward model** (the Plan tab's reward function is empty): "
               "a model, not a function, so there is nothing to check on these rows here; the Evaluate tab shows "
               "its score of each answer. To check a function, type one in the Plan tab (e.g. `builtin:reverse`).")


"""The monitor's *Sample history*: a slider over the attached run's iterations showing that iteration's
samples with their scores, its best and worst ``k`` by reward, and one prompt's answers across the
iterations (picked from a list). It follows a run while it grows: the monitor's timer reads
``samples.jsonl`` again when the file changed, and a slider left at the newest iteration moves on to the
next one; a slider moved back stays where it was put.

The tables come from :mod:`homerlhf.app.sample_history`; this module reads the file and lays them out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from homerlhf.app import runs
from homerlhf.app import sample_history as sh

K_DEFAULT = 3
MAX_PROMPTS = 200  # a long run's list of prompts: those answered most often, where answers can be compared
EMPTY = "No samples logged yet: each iteration's appear here as the run writes them (samples.jsonl)."
WIDTHS = ["110px", "25%", "50%", "90px", "90px"]
RANKED_WIDTHS = ["80px", "30%", "60%"]


# Per samples file: (bytes read, the last of them, the rows of those bytes). The file only grows while a
# run writes, so each read parses only what was appended since the last one: a slider move or a poll does
# not parse a large history again. A resume cuts it back to its checkpoint's size and writes on: the bytes
# last read are no longer where they were, and it is read again from the start.
_READ: dict[str, tuple[int, bytes, list[dict]]] = {}
TAIL = 256


def read_rows(run_dir: str) -> list[dict]:
    """The rows of the run's ``samples.jsonl`` up to its last whole line (a line being written waits)."""
    path = Path(run_dir) / runs.SAMPLES_FILE
    try:
        fh = path.open("rb")
    except OSError:
        _READ.pop(str(path), None)
        return []
    with fh:
        done, tail, rows = _READ.get(str(path), (0, b"", []))
        fh.seek(done - len(tail))
        if fh.read(len(tail)) != tail:  # cut back and written again: from the start
            done, tail, rows = 0, b"", []
            fh.seek(0)
        chunk = fh.read()
    whole = chunk[:chunk.rfind(b"\n") + 1]
    if whole:
        rows = rows + _parse(whole)
        done += len(whole)
        tail = (tail + whole)[-TAIL:]
    _READ[str(path)] = (done, tail, rows)
    return rows


def _parse(data: bytes) -> list[dict]:
    out = []
    for line in data.decode("utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            out.append(row)
    return out


def read_history(run_dir: str) -> dict[int, list[dict]]:
    return sh.by_iteration(read_rows(run_dir)) if run_dir else {}


def file_stamp(run_dir: str) -> list:
    """What says the samples file changed: the run, the file's size and modification time."""
    if not run_dir:
        return ["", 0, 0]
    try:
        stat = (Path(run_dir) / runs.SAMPLES_FILE).stat()
    except OSError:
        return [run_dir, 0, 0]
    return [run_dir, stat.st_size, stat.st_mtime_ns]


@dataclass
class IterationView:
    """One iteration's part of the panel: the iteration shown (None: no samples), the line over the tables,
    its samples, its best and worst ``k``."""

    iteration: Optional[int]
    summary: str
    samples: list
    top: list
    bottom: list


def iteration_view(history: dict[int, list[dict]], wanted: Optional[float], k: Any) -> IterationView:
    """The iteration nearest ``wanted`` (the newest when None) with its tables."""
    shown = sh.nearest(list(history), wanted)
    if shown is None:
        return IterationView(None, EMPTY, [], [], [])
    samples = history[shown]
    top, bottom = sh.top_bottom(samples, _k(k))
    return IterationView(shown, sh.summary(shown, samples, wanted), sh.iteration_rows(samples), top, bottom)


def _k(k: Any) -> int:
    try:
        return max(1, int(k))
    except (TypeError, ValueError):
        return K_DEFAULT


def slider_value(history: dict[int, list[dict]], wanted: Optional[float], last_seen: Optional[int]) -> Optional[int]:
    """Where the slider goes when the file grew: on to the newest iteration when it stood at the newest one
    seen before (or nowhere yet), else where the user left it."""
    if not history:
        return None
    newest = max(history)
    if wanted is None or last_seen is None or int(wanted) >= last_seen:
        return newest
    return int(wanted)


def prompt_choice(history: dict[int, list[dict]], current: Optional[str]) -> tuple[list[str], Optional[str]]:
    """The prompts to pick from (the ``MAX_PROMPTS`` answered in the most iterations) and the one picked: the
    current pick while the list still has it, else the prompt answered in the most iterations."""
    choices = sh.prompts(history)[:MAX_PROMPTS]
    return choices, current if current in choices else (choices[0] if choices else None)


def poll(run_dir: str, wanted, k, prompt, stamp) -> tuple:
    """The timer's update of the panel (``outputs`` order, then the new stamp); nothing changes while the
    samples file is as it was at the last poll (``stamp``)."""
    import gradio as gr

    now = file_stamp(run_dir)
    if stamp and list(stamp[:3]) == now:
        return (gr.update(),) * 7 + (stamp,)
    same_run = bool(stamp) and stamp[0] == run_dir
    history = read_history(run_dir)
    last_seen = stamp[3] if same_run and len(stamp) > 3 else None
    value = slider_value(history, wanted if same_run else None, last_seen)
    view = iteration_view(history, value, k)
    choices, picked = prompt_choice(history, prompt if same_run else None)
    its = list(history) or [1]
    # Gradio's slider needs its maximum above its minimum: with one iteration it is still, one past it.
    slider = gr.update(minimum=its[0], maximum=max(its[-1], its[0] + 1), value=value or its[0],
                       interactive=len(history) > 1)
    return (slider, view.summary, view.samples, view.top, view.bottom,
            gr.update(choices=choices, value=picked), sh.across(history, picked) if picked else [],
            [*now, max(history) if history else None])


def show_iteration(run_dir: str, wanted, k) -> tuple:
    """The slider (or ``k``) moved: the summary, samples, best and worst of the iteration it stands on."""
    view = iteration_view(read_history(run_dir), wanted, k)
    return view.summary, view.samples, view.top, view.bottom


def show_prompt(run_dir: str, prompt) -> list:
    return sh.across(read_history(run_dir), prompt) if prompt else []


@dataclass
class HistoryPanel:
    iteration: Any
    k: Any
    summary: Any
    samples: Any
    top: Any
    bottom: Any
    prompt: Any
    across: Any
    stamp: Any  # gr.State: file_stamp at the last poll, and the newest iteration then

    @property
    def outputs(self) -> list:
        return [self.iteration, self.summary, self.samples, self.top, self.bottom, self.prompt, self.across,
                self.stamp]


def layout() -> HistoryPanel:
    import gradio as gr

    with gr.Accordion("Sample history", open=True, elem_id="train-history"):
        with gr.Row():
            iteration = gr.Slider(1, 2, value=1, step=1, label="Iteration", scale=4, interactive=False,
                                  elem_id="train-history-iteration",
                                  info="Each iteration's samples, as the trainer kept them (samples.jsonl)")
            k = gr.Number(K_DEFAULT, precision=0, minimum=1, maximum=50, label="Best and worst: how many", scale=1,
                          elem_id="train-history-k")
        summary = gr.Markdown(EMPTY, elem_id="train-history-summary")
        samples = gr.Dataframe(headers=sh.COLUMNS, label="That iteration's samples", wrap=True, interactive=False,
                               column_widths=WIDTHS, elem_id="train-history-samples")
        with gr.Row():
            top = gr.Dataframe(headers=sh.RANKED_COLUMNS, label="Best by reward", wrap=True, interactive=False,
                               column_widths=RANKED_WIDTHS, elem_id="train-history-top")
            bottom = gr.Dataframe(headers=sh.RANKED_COLUMNS, label="Worst by reward", wrap=True, interactive=False,
                                  column_widths=RANKED_WIDTHS, elem_id="train-history-bottom")
        # A custom value is let through: a poll already sent holds the pick a new run's (empty) list no longer
        # has, and the answers of a prompt not in the list are simply none.
        prompt = gr.Dropdown([], label="One prompt's answers across iterations", allow_custom_value=True,
                             elem_id="train-history-prompt")
        across = gr.Dataframe(headers=sh.ACROSS_COLUMNS, label="Its answers, oldest first", wrap=True,
                              interactive=False, column_widths=["100px", "70%", "90px", "90px"],
                              elem_id="train-history-across")
    return HistoryPanel(iteration, k, summary, samples, top, bottom, prompt, across, gr.State([]))


def wire(panel: HistoryPanel, attached, timer) -> None:
    """The panel follows the attached run (``attached``, a gr.State) at each ``timer`` tick and on attach."""
    inputs = [attached, panel.iteration, panel.k, panel.prompt, panel.stamp]
    timer.tick(poll, inputs, panel.outputs, show_progress="hidden")
    attached.change(poll, inputs, panel.outputs, show_progress="hidden")
    for event in (panel.iteration.change, panel.k.change):
        event(show_iteration, [attached, panel.iteration, panel.k],
              [panel.summary, panel.samples, panel.top, panel.bottom], show_progress="hidden")
    panel.prompt.change(show_prompt, [attached, panel.prompt], panel.across, show_progress="hidden")

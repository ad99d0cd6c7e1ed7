"""The page's settings kept on disk, and the line that says what is active.

``RUNS/page-settings.json`` holds what the page shows of the next run: the Plan tab's preset, model,
overrides (the run length and the Data tab's *Use for training* are written there), GPU GiB, algorithm
and reward boxes, and the Data tab's choice (source, dataset, upload, use, split, max rows, column
names). Every change writes it, and every page load puts it back (:func:`restored`), so a reload, a new
browser tab or a restarted app shows, and *Start* runs, what the page showed before.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any, Optional

from homerlhf.app.common import md_text
from homerlhf.errors import UserError

FILE = "page-settings.json"
_SAVING = threading.Lock()  # one change's save at a time: several fire together (a load sets many boxes)


def settings_path(runs_root: str | Path) -> Path:
    return Path(runs_root) / FILE


def load(runs_root: str | Path) -> dict[str, Any]:
    """The saved settings ({} for none, or for a file that does not read as an object)."""
    try:
        data = json.loads(settings_path(runs_root).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def save(runs_root: str | Path, names: list[str], values: tuple) -> None:
    """``values`` (of the components ``names``) written over the saved ones, atomically."""
    path = settings_path(runs_root)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _SAVING:
        data = {**load(runs_root), **dict(zip(names, values))}
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data, indent=1, ensure_ascii=False), encoding="utf-8")
        os.replace(tmp, path)


def restored(runs_root: str | Path, names: list[str]) -> tuple:
    """The saved value of each of ``names``, or ``gr.update()`` (left as it is) where none was saved."""
    import gradio as gr

    data = load(runs_root)
    return tuple(data[name] if name in data else gr.update() for name in names)


def iterations_of(preset: str, model: str, overrides: str, preset_model: Optional[str]):
    """``ppo.iterations`` of these settings (``gr.update()`` while they do not resolve)."""
    import gradio as gr

    from homerlhf.app.plan_tab import resolved_config

    try:
        return resolved_config(preset, model, overrides, preset_model).ppo.iterations
    except UserError:
        return gr.update()


def set_iterations(value, overrides: str) -> str:
    """The overrides with the *Iterations* field's ``ppo.iterations``; a bad value is one line naming the field."""
    from homerlhf.app.common import set_override

    if value is None or float(value) != int(value) or int(value) < 1:
        shown = "empty" if value is None else f"{value:g}"
        raise UserError(f"'Iterations' is {shown}: give a whole number of iterations, 1 or more (e.g. 20)")
    return set_override(overrides, "ppo.iterations", str(int(value)))


def active_markdown(preset: str, model: str, overrides: str, preset_model: Optional[str]) -> str:
    """What the next *Start training* trains: preset (and its card), model, data, algorithm, length and overrides."""
    from homerlhf.app.plan_tab import resolved_config, run_overrides

    try:
        cfg = resolved_config(preset, model, overrides, preset_model)
        items = run_overrides(model, overrides, preset_model)
    except UserError as exc:
        return f"**Active settings:** none can run yet: {md_text(str(exc))} (fix it in the Plan tab's overrides)."
    prompts = getattr(cfg.data, "prompts", None)
    data = (f"{code(prompts)}" + ("" if any(i.startswith("data.prompts=") for i in items) else " (the preset's)")
            if prompts else "none yet (pick your prompts in the Data tab)")
    card = f"{cfg.card.name}, {cfg.card.gpu_gib:g} GiB" if cfg.card.gpu_gib else "CPU only"
    shown = ", ".join(code(i) for i in items[:4]) + (f" and {len(items) - 4} more" if len(items) > 4 else "")
    return (f"**Active settings** (what *Start training* runs): preset {code(preset)} ({md_text(card)}) · model "
            f"{code(cfg.model.name_or_path)} · data {data} · {cfg.algorithm.upper()}, {cfg.ppo.iterations} "
            f"iteration{'s' if cfg.ppo.iterations != 1 else ''} · overrides: {shown or 'none'}")


def code(text) -> str:
    """``text`` as a Markdown code span (shown as it is: no escapes inside; a backtick in it widens the fence)."""
    text = str(text)
    fence = "``" if "`" in text else "`"
    return f"{fence} {text} {fence}" if fence == "``" else f"`{text}`"

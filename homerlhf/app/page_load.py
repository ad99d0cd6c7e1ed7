"""What opening or reloading the page brings back.

A page load re-attaches the newest running run (:func:`homerlhf.app.train_tab.on_page_load`); with none
running, the newest run of any state is attached instead, so Evaluate and Export have a run after a
reload too (a Start still goes to a fresh directory). A running run's Plan settings — its preset, model,
overrides, algorithm and reward boxes — are read back from the command it was launched with
(``RUN_DIR/app/launch.json``), so *What Start runs* describes that run and not the preset's defaults.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from homerlhf.app import runs

RESTORED = "Its preset, model and overrides are back in the Plan tab."


def running_run(runs_root: str) -> Optional[str]:
    """The newest running run under ``runs_root`` (the one the Train tab re-attaches), or None."""
    from homerlhf.app.train_tab import known_runs

    return next((p for p in known_runs("", runs_root) if runs.run_status(p).running), None)


def launched_items(run_dir: str) -> Optional[tuple[str, list[str]]]:
    """(preset, the ``--set`` overrides in order) of the command the app launched in ``run_dir``; None for
    a run without a launch record (one started from a shell) or one launched from a YAML (``--config``)."""
    argv = runs.run_status(run_dir).argv
    if not argv or argv[0] != "train" or "--preset" not in argv or "--config" in argv:
        return None
    preset = argv[argv.index("--preset") + 1]
    return preset, [argv[i + 1] for i, word in enumerate(argv[:-1]) if word == "--set"]


def reward_boxes(items: list[str]) -> tuple[str, str]:
    """The Plan tab's reward function and components boxes that wrote these overrides ('' where none did)."""
    import yaml

    values = dict(item.split("=", 1) for item in items)
    function = values.get("reward.function", "") if values.get("reward.backend") == "function" else ""
    lines = []
    try:
        components = yaml.safe_load(values.get("reward.components", "[]")) or []
    except yaml.YAMLError:
        components = []
    for c in components if isinstance(components, list) else []:
        spec = (f"rm:{c.get('model')}" if c.get("backend") == "llamacpp" else c.get("function")) if isinstance(c, dict) else None
        if spec and isinstance(c.get("weight"), (int, float)):
            lines.append(f"{c['weight']:g} {spec}")
    return function, "\n".join(lines)


def settings_of(run_dir: str) -> Optional[dict]:
    """The Plan settings that launched ``run_dir`` (see :func:`launched_items`), or None."""
    from homerlhf.app.plan_tab import preset_model_of

    launched = launched_items(run_dir)
    if launched is None:
        return None
    preset, items = launched
    values = dict(item.split("=", 1) for item in items)
    default = preset_model_of(preset)
    model = values.get("model.name_or_path", default)
    function, components = reward_boxes(items)
    return {"preset": preset, "model": model, "overrides": "\n".join(items), "preset_model": default,
            "algorithm": values.get("algorithm", "ppo"), "reward_function": function,
            "reward_components": components, "typed": {preset: model} if model != default else {}}


def settings_outputs(settings) -> list:
    """The Plan components :func:`restore_settings` sets (``settings``: :class:`plan_tab.Settings`)."""
    return [settings.preset, settings.model, settings.overrides, settings.preset_model, settings.shown_preset,
            settings.algorithm, settings.reward_function, settings.reward_components, settings.typed_models]


def restore_settings(runs_root: str) -> tuple:
    """The page's Plan settings: the running run's (:func:`settings_of`), else unchanged."""
    import gradio as gr

    running = running_run(runs_root)
    found = settings_of(running) if running else None
    if found is None:
        return tuple(gr.update() for _ in range(9))
    return (found["preset"], found["model"], found["overrides"], found["preset_model"], found["preset"],
            found["algorithm"], found["reward_function"], found["reward_components"], found["typed"])


def attach_on_load(reattached: tuple, runs_root: str) -> tuple:
    """The Train tab's page-load outputs (:func:`homerlhf.app.train_tab.on_page_load`: runs list,
    attached, shared run dir, run dir box, *monitor outputs, message last) with the newest run attached
    when none was running (the run dir box stays a fresh directory for the next Start), and the
    re-attach line saying where a running run's settings went."""
    from homerlhf.app.train_tab import refresh

    out = list(reattached)
    if out[1]:
        if settings_of(out[1]) is not None:
            out[-1] = f"{out[-1]} {RESTORED}"
        return tuple(out)
    found = runs.list_runs(runs_root)
    if not found:
        return tuple(out)
    latest = str(found[0])
    status = runs.run_status(latest)
    out[1] = out[2] = latest
    out[4:] = refresh(latest, -1, status.state)
    out[-1] = (f"Attached to the latest run `{latest}` ({status.message()}): Evaluate and Export use it; "
               f"Start begins a new run in `{Path(out[3]).name}`.")
    return tuple(out)


def wire(blocks, settings, plan_load: tuple, train_loads: list[tuple], runs_root: str) -> None:
    """The page's load events: the Plan settings restored, then the plan drawn from them and, beside it, the
    Train tab's re-attach (``train_loads[0]``, the newest run attached when none runs), then the Start command."""
    chain = blocks.load(lambda: restore_settings(runs_root), None, settings_outputs(settings))
    chain.then(*plan_load)
    reattach, inputs, outputs = train_loads[0]
    attached = chain.then(lambda: attach_on_load(reattach(), runs_root), inputs, outputs)
    for event in train_loads[1:]:  # the Start command: of the restored settings and the run dir box as attached
        attached.then(*event)

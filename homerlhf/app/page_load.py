"""What opening or reloading the page brings back.

The page's settings as it left them (:mod:`homerlhf.app.page_settings`: the Plan and Data tabs' choices,
the run length in the overrides), so *Start* runs what the page showed before. With none saved, a running
run's Plan settings — its preset, model, overrides, algorithm and reward boxes — are read back from the
command it was launched with (``RUN_DIR/app/launch.json``). A page load re-attaches the newest running
run (:func:`homerlhf.app.train_tab.on_page_load`); with none running, the newest run of any state is
attached instead, so Evaluate and Export have a run after a reload too (a Start goes to a fresh directory).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from homerlhf.app import page_settings, runs
from homerlhf.app.common import log

RESTORED = "Its preset, model and overrides are back in the Plan tab."
KEPT = ("The Plan tab shows the settings you left, not the ones the running run started with (its command is the "
        "first line of its log).")
# The Plan settings the page keeps (page_settings), as named in the saved file.
PLAN_NAMES = ("preset", "model", "overrides", "algorithm", "reward_function", "reward_components", "typed_models",
              "gpu_gib")


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
            settings.algorithm, settings.reward_function, settings.reward_components, settings.typed_models,
            settings.gpu_gib]


def saved_settings(runs_root: str) -> Optional[dict]:
    """The Plan settings the page left (:mod:`page_settings`), in :func:`settings_of`'s shape; None for none
    (or a preset that no longer exists)."""
    from homerlhf.app.plan_tab import preset_model_of
    from homerlhf.config import preset_names

    saved = page_settings.load(runs_root)
    if saved.get("preset") not in preset_names():
        return None
    default = preset_model_of(saved["preset"])
    return {"preset": saved["preset"], "model": saved.get("model") or default, "preset_model": default,
            "overrides": saved.get("overrides") or "", "algorithm": saved.get("algorithm") or "ppo",
            "reward_function": saved.get("reward_function") or "", "reward_components": saved.get("reward_components") or "",
            "typed": saved.get("typed_models") or {}, "gpu_gib": saved.get("gpu_gib") or 0}


def restore_settings(runs_root: str, extra_names: tuple = ()) -> tuple:
    """The page's Plan settings (``settings_outputs``): the ones it left, else the running run's
    (:func:`settings_of`), else unchanged; then the saved value of each of ``extra_names`` (the Data tab's)."""
    import gradio as gr

    found = saved_settings(runs_root)
    if found is None:
        running = running_run(runs_root)
        found = settings_of(running) if running else None
    extra = list(page_settings.restored(runs_root, list(extra_names)))
    for i, name in enumerate(extra_names):  # an upload kept no longer there: the box stays empty
        if name == "data_upload" and isinstance(extra[i], str) and not Path(extra[i]).is_file():
            extra[i] = gr.update()
    if found is None:
        return (*(gr.update() for _ in range(10)), *extra)
    return (found["preset"], found["model"], found["overrides"], found["preset_model"], found["preset"],
            found["algorithm"], found["reward_function"], found["reward_components"], found["typed"],
            found.get("gpu_gib", gr.update()), *extra)


def _same_as_launched(runs_root: str, launched: dict) -> bool:
    """Whether the Plan settings the page left would launch what ``launched`` (:func:`settings_of`) did."""
    from homerlhf.app.plan_tab import run_overrides
    from homerlhf.errors import UserError

    saved = saved_settings(runs_root)
    if saved is None:
        return True  # the page took the run's own settings
    try:
        items = run_overrides(saved["model"], saved["overrides"], saved["preset_model"])
    except UserError:
        return False
    return saved["preset"] == launched["preset"] and items == run_overrides(
        launched["model"], launched["overrides"], launched["preset_model"])


def attach_on_load(reattached: tuple, runs_root: str) -> tuple:
    """The Train tab's page-load outputs (:func:`homerlhf.app.train_tab.on_page_load`: runs list,
    attached, shared run dir, run dir box, *monitor outputs, message last) with the newest run attached
    when none was running (the run dir box stays a fresh directory for the next Start), and the
    re-attach line saying where a running run's settings went."""
    from homerlhf.app.train_tab import refresh

    out = list(reattached)
    if out[1]:
        launched = settings_of(out[1])
        if launched is not None:
            out[-1] = f"{out[-1]} {RESTORED if _same_as_launched(runs_root, launched) else KEPT}"
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


def wire(blocks, settings, plan_load: tuple, train_loads: list[tuple], runs_root: str, kept: dict) -> None:
    """The page's load events: the settings restored (the Plan tab's and ``kept``, name -> component: the
    Data tab's), then the plan drawn from them and, beside it, the Train tab's re-attach (``train_loads[0]``,
    the newest run attached when none runs), then the Start command. Every change of a setting is saved."""
    from homerlhf.app.train_tab import MONITOR  # the re-attach draws the monitor: one at a time with its polls

    names = tuple(kept)
    chain = blocks.load(lambda: restore_settings(runs_root, names), None, [*settings_outputs(settings), *kept.values()])
    chain.then(*plan_load)
    reattach, inputs, outputs = train_loads[0]
    attached = chain.then(lambda: attach_on_load(reattach(), runs_root), inputs, outputs, **MONITOR)
    for event in train_loads[1:]:  # the Start command: of the restored settings and the run dir box as attached
        attached.then(*event)


def keep(settings, kept: dict, runs_root: str) -> None:
    """Save the page's settings (the Plan tab's and ``kept``) on each change of one of them."""
    from homerlhf.app.data_tab import keep_upload, uploads_dir

    plan = [getattr(settings, name) for name in PLAN_NAMES]
    names, components = [*PLAN_NAMES, *kept], [*plan, *kept.values()]

    def save(*values):
        values = list(values)
        for i, name in enumerate(names):  # an upload is kept where Gradio does not delete it
            if name == "data_upload" and values[i] and Path(values[i]).parent != uploads_dir():
                values[i] = keep_upload(values[i])
        try:
            page_settings.save(runs_root, names, tuple(values))
        except OSError as exc:  # a read-only runs folder: the page works on, its settings are not kept
            log.warning("cannot keep the page's settings in %s: %s", runs_root, exc.strerror or exc)

    for component in components:
        component.change(save, components, None, show_progress="hidden")

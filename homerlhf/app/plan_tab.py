"""The Plan tab: pick a preset (a card) and a model, see the memory plan per PPO phase as a stacked
bar chart, a table and a verdict; apply the planner's suggestion; see the equivalent
``homerlhf train`` command; save the run config as YAML.

The numbers are :mod:`homerlhf.memory.planner`'s; this tab lays them out and keeps the run
settings (preset, model, overrides) that the Data and Train tabs share.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from homerlhf.app import runs
from homerlhf.app.common import guarded, md_text, parse_overrides, set_override
from homerlhf.app.plan_apply import NO_FIT, apply_choice, on_apply, suggestion_overrides  # noqa: F401 - the tab's API
from homerlhf.app.plan_time import slowest_phase, time_markdown  # noqa: F401 - the tab's API
from homerlhf.errors import UserError


@dataclass
class Settings:
    """The run settings components, created before the tabs and rendered in this one."""

    preset: Any
    model: Any
    overrides: Any
    gpu_gib: Any
    preset_model: Any  # gr.State: the preset's own model, to tell a user's choice from the default
    algorithm: Any = None  # ppo / grpo / rloo, written into the overrides
    reward_function: Any = None  # the run's reward as a function (empty: the preset's), into the overrides
    reward_components: Any = None  # more rewards, one "WEIGHT SPEC" per line, into the overrides
    typed_models: Any = None  # gr.State: {preset: the model the user typed while on it}
    shown_preset: Any = None  # gr.State: the preset the model box was last set for
    applied: Any = None  # gr.State: {"preset": ..., "items": [...]}: the suggestion last applied


def preset_model_of(preset: str) -> str:
    from homerlhf.config import load_config

    return load_config(preset).model.name_or_path


def settings_components(default_preset: str) -> Settings:
    import gradio as gr

    from homerlhf.config import preset_names

    model = preset_model_of(default_preset)
    return Settings(
        preset=gr.Dropdown(preset_names(), value=default_preset, label="Preset (card)", render=False,
                           elem_id="plan-preset"),
        model=gr.Textbox(model, label="Model (hub id, local dir or builtin:<name>)", render=False,
                         elem_id="plan-model"),
        overrides=gr.Textbox("", lines=4, label="Overrides (one section.key=value per line)", render=False,
                             placeholder="ppo.iterations=20\nrollout.batch_size=16", elem_id="plan-overrides"),
        gpu_gib=gr.Number(0, label="Plan for GPU GiB (0: the preset's card)", render=False,
                          elem_id="plan-gpu-gib"),
        preset_model=gr.State(model),
        algorithm=gr.Radio(["ppo", "grpo", "rloo"], value="ppo", label="Algorithm", render=False,
                           info="grpo / rloo: no critic, group.size samples per prompt", elem_id="plan-algorithm"),
        reward_function=gr.Textbox("", label="Reward function (empty: the preset's reward model)", render=False,
                                   placeholder="builtin:reverse or path/to/rewards.py:fn", elem_id="plan-reward-function"),
        reward_components=gr.Textbox("", lines=2, label="More rewards, one 'WEIGHT SPEC' per line", render=False,
                                     placeholder="0.5 builtin:reverse-positions\n0.2 rm:builtin:demo-rm",
                                     elem_id="plan-reward-components"),
        typed_models=gr.State({}),
        shown_preset=gr.State(default_preset),
        applied=gr.State({}),
    )


def run_overrides(model: str, overrides_text: str, preset_model: Optional[str]) -> list[str]:
    """The overrides, plus ``model.name_or_path`` when the model differs from the preset's."""
    items = parse_overrides(overrides_text)
    model = (model or "").strip()
    if model and model != preset_model and not any(i.startswith("model.name_or_path=") for i in items):
        items.insert(0, f"model.name_or_path={model}")
    return items


def resolved_config(preset: str, model: str, overrides_text: str, preset_model: Optional[str]):
    from homerlhf.config import load_config

    return load_config(preset, None, run_overrides(model, overrides_text, preset_model))


def card_markdown(preset: str) -> str:
    from homerlhf.config import load_config

    cfg = load_config(preset)
    mem = f"{cfg.card.gpu_gib:g} GiB GPU" if cfg.card.gpu_gib else "CPU only"
    return (f"**{cfg.card.name}** · {mem} · trains on `{cfg.card.device}` · default model "
            f"`{cfg.model.name_or_path}`  \n{cfg.description}")


def command_text(preset: str, model: str, overrides_text: str, preset_model: Optional[str],
                 out: Optional[str] = None) -> str:
    items = run_overrides(model, overrides_text, preset_model)
    return runs.format_command(runs.train_argv(preset, out or "runs/my-run", None, items), multiline=True)


# -- the planner, laid out ----------------------------------------------------------------------


def compute_plan(cfg, gpu_gib: Optional[float], calibration: str = ""):
    """The planner's ``Plan`` for this config (its model shape resolved without any download), with
    its ``auto`` settings resolved as a run would resolve them.

    ``gpu_gib`` 0 or None plans for the preset's card; ``calibration``: a `homerlhf check` report's path
    (empty: none), as `homerlhf plan --calibration` reads it."""
    from homerlhf.memory.check_report import calibrated_plan, read_report
    from homerlhf.memory.render import shape_for
    from homerlhf.models.reward_kinds import possible_reward_backends
    from homerlhf.workers.bench import cached_throughputs

    if gpu_gib is not None and gpu_gib < 0:
        raise UserError(f"'Plan for GPU GiB' is {gpu_gib:g}: give 0 (plan for the preset's card) or your card's "
                        "memory in GiB, e.g. 24")
    path = Path(calibration.strip()).expanduser() if (calibration or "").strip() else None
    report = read_report(path) if path is not None else None  # a bad report: one line, before anything loads
    shape = shape_for(cfg)
    rewards = possible_reward_backends(cfg.reward.model, cfg.model.name_or_path)
    return calibrated_plan(cfg, shape, cached_throughputs(cfg, shape), float(gpu_gib) if gpu_gib else None,
                           rewards, report, str(path))


def plan_table(plan) -> tuple[list[str], list[list]]:
    """(headers, rows): one row per component, one column per phase, and the totals; in GiB, or
    in MiB when the whole plan is under 1 GiB (tiny models would read as all zeros)."""
    unit, scale = ("GiB", 1.0) if plan.peak_gib >= 1 else ("MiB", 1024.0)
    names: list[str] = []
    for phase in plan.phases:
        names += [c.name for c in phase.components if c.name not in names]
    rows = [["total", *[round(phase.total_gib * scale, 3) for phase in plan.phases]]]  # first: what matters
    for name in names:
        per_phase = [sum(c.gib for c in phase.components if c.name == name) * scale for phase in plan.phases]
        rows.append([name, *[round(v, 3) for v in per_phase]])
    return [f"component ({unit})", *[f"{p.name} ({p.moment})" for p in plan.phases]], rows


def table_value(headers: list[str], rows: list[list]):
    """The table as the app shows it: a pandas Styler with the total row (the first) in bold on a tint."""
    import pandas as pd

    frame = pd.DataFrame(rows, columns=headers)
    styled = frame.style.apply(lambda row: [TOTAL_STYLE if row.name == 0 else ""] * len(row), axis=1)
    return styled.format(precision=3)


TOTAL_STYLE = "font-weight: bold; background-color: #fff3cd"


# Words, not emoji: where only DejaVu fonts are installed an emoji is an empty box.
VERDICT_MARKS = {"fits": "OK: ", "tight": "TIGHT: ", "over": "NO: ", None: ""}


def verdict_markdown(plan) -> str:
    mark = VERDICT_MARKS[plan.status]
    lines = [f"**{mark}{plan.verdict(gpu_hint=GPU_HINT)}**"]
    if plan.fits is False:
        if plan.suggestion is None:
            lines.append(NO_FIT[0].upper() + NO_FIT[1:] + ".")
        else:
            sug = plan.suggestion
            restores = "restores the margin" if plan.status == "tight" else "fits"
            lines.append(f"**Suggestion** that {restores} (peak {sug.peak_gib:.2f} GiB, {sug.headroom_gib:.2f} GiB "
                         f"headroom): `{' '.join(sug.set_args)}` — press *Apply suggestion*.")
    lines += [f"Note: {note}" for note in plan.notes]
    return "\n\n".join(lines)


GPU_HINT = "set *Plan for GPU GiB* to plan for a card"


def plan_figure(plan):
    from homerlhf.memory.render import plan_figure as figure

    return figure(plan)


def save_yaml(cfg, path: str) -> Path:
    from homerlhf.config import to_yaml

    if not (path or "").strip():
        raise UserError("give a file name for the YAML, e.g. runs/my-run.yaml")
    out = Path(path.strip()).expanduser()
    if out.suffix not in (".yaml", ".yml"):
        raise UserError(f"{out} should end in .yaml")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(to_yaml(cfg))
    return out


# -- layout ---------------------------------------------------------------------------------


@dataclass
class PlanPanel:
    """The tab's own components (the run settings are :class:`Settings`)."""

    card: Any
    plan_btn: Any
    apply_btn: Any
    message: Any
    verdict: Any
    chart: Any
    table: Any
    command: Any
    yaml_path: Any
    save_btn: Any
    save_message: Any  # under Save YAML: its confirmation or error where the button is
    suggestion: Any  # gr.State: what Apply applies for the last plan (apply_choice), {} before one
    time: Any = None  # Markdown: seconds per phase and the placement recommendation
    calibration: Any = None  # Textbox: a `homerlhf check` report's path (empty: the H200's scaled figures)

    @property
    def plan_outputs(self) -> list:
        return [self.message, self.verdict, self.chart, self.table, self.command, self.suggestion, self.time]


def _layout(settings: Settings) -> PlanPanel:
    import gradio as gr

    with gr.Row():
        settings.preset.render()
        settings.model.render()
        settings.gpu_gib.render()
        if settings.algorithm is not None:
            settings.algorithm.render()
    if settings.reward_function is not None:
        with gr.Row():
            settings.reward_function.render()
            settings.reward_components.render()
    card = gr.Markdown(elem_id="plan-card")
    settings.overrides.render()
    calibration = gr.Textbox("", label="Calibration: a `homerlhf check` report (JSON path; empty: none)",
                             placeholder="homerlhf-check.json", elem_id="plan-calibration")
    with gr.Row():
        plan_btn = gr.Button("Plan", variant="primary", elem_id="plan-run")
        apply_btn = gr.Button("Apply suggestion", elem_id="plan-apply")
    message = gr.Markdown(elem_id="plan-message")
    verdict = gr.Markdown(elem_id="plan-verdict")
    chart = gr.Plot(label="Memory per phase", elem_id="plan-chart")
    table = gr.Dataframe(label="Memory per component and phase", interactive=False, elem_id="plan-table",
                         column_widths=["31%", "23%", "23%", "23%"])
    time = gr.Markdown(elem_id="plan-time")
    command = gr.Code(label="Equivalent command", language="shell", interactive=False, lines=2, elem_id="plan-command")
    with gr.Row():
        yaml_path = gr.Textbox("runs/run.yaml", label="Save run config as", scale=3, elem_id="plan-yaml-path")
        save_btn = gr.Button("Save YAML", elem_id="plan-save")
    save_message = gr.Markdown(elem_id="plan-save-message")
    return PlanPanel(card, plan_btn, apply_btn, message, verdict, chart, table, command, yaml_path, save_btn,
                     save_message, suggestion=gr.State({}), time=time, calibration=calibration)


def on_algorithm(algorithm: str, overrides: str) -> str:
    """The overrides with ``algorithm`` set; GRPO / RLOO get a group of 4 unless one is set already."""
    overrides = set_override(overrides, "algorithm", algorithm)
    has_group = any(item.startswith(("group.size=", "ppo.group_size=")) for item in parse_overrides(overrides))
    if algorithm != "ppo" and not has_group:
        overrides = set_override(overrides, "group.size", "4")
    return overrides


def on_rewards(overrides: str, function: str, components: str) -> tuple[str, str]:
    """The reward boxes written into the overrides (replacing earlier reward settings)."""
    from homerlhf.app.rewards import apply_rewards

    return "", apply_rewards(overrides, function, components)


def on_preset(preset, model, preset_model, shown, overrides, typed, applied):
    """A new preset: its card; the model reset to the preset's own (unless the user typed one while on
    this preset); the previous preset's applied suggestion taken out of the overrides; and a line
    saying what was reset, removed and kept. ``model`` / ``preset_model`` / ``shown``: the box, the
    default it was set to and the preset it was set for (a box that differs was typed for that preset).
    Returns (card, model, preset model, overrides, message, typed, shown)."""
    if preset == shown:  # the same pick again (a browser can send one selection twice): nothing to reset
        import gradio as gr

        return tuple(gr.update() for _ in range(7))
    typed = dict(typed or {})
    if (model or "").strip() and model != preset_model:
        typed[shown] = model
    else:
        typed.pop(shown, None)
    new_default = preset_model_of(preset)
    model = typed.get(preset) or new_default
    items = parse_overrides(overrides)
    removed = [] if (applied or {}).get("preset") in (None, preset) else \
        [i for i in items if i in (applied or {}).get("items", [])]
    kept = [i for i in items if i not in removed]
    said = [f"Preset **{md_text(preset)}**: model `{model}`" + (" (the one you typed for it)" if model != new_default
                                                                else " (the preset's)") + "."]
    if removed:
        said.append(f"Took out the {md_text(applied['preset'])} suggestion: {' '.join(f'`{i}`' for i in removed)}.")
    if kept:
        said.append(f"Kept your overrides: {' '.join(f'`{i}`' for i in kept)}.")
    return card_markdown(preset), model, new_default, "\n".join(kept), " ".join(said), typed, preset


def on_save(preset, model, overrides, preset_model, path):
    out = save_yaml(resolved_config(preset, model, overrides, preset_model), path)
    return f"Saved `{out}`. Train with it: `homerlhf train --preset {preset} --config {out}`"


def plan_outputs(preset, model, overrides, preset_model, gpu_gib, calibration: str = "") -> tuple:
    """The plan of these settings as the tab shows it, message box first (empty)."""
    import gradio as gr

    cfg = resolved_config(preset, model, overrides, preset_model)
    plan = compute_plan(cfg, gpu_gib, calibration)
    headers, rows = plan_table(plan)
    return ("", verdict_markdown(plan), plan_figure(plan), gr.update(value=table_value(headers, rows), headers=headers),
            command_text(preset, model, overrides, preset_model), apply_choice(plan),
            time_markdown(plan, cfg.reward.model))


# A plan that fails leaves no verdict, chart, table or time of the settings before it on screen.
STALE_ON_ERROR = {1: "", 2: None, 3: None, 5: {}, 6: ""}


def build(settings: Settings):
    """Lay out the tab. Returns (load handler, its inputs, its outputs) for the page's load event."""
    import gradio as gr

    gr.Markdown("### Plan\nA preset is a memory plan for one card. The planner adds up the bytes of every "
                "component in each PPO phase and says whether it fits.")
    panel = _layout(settings)
    s = settings
    inputs = [s.preset, s.model, s.overrides, s.preset_model, s.gpu_gib, panel.calibration]
    on_plan = guarded(7, error_index=0, on_error=STALE_ON_ERROR)(plan_outputs)

    @guarded(7, error_index=0, on_error=STALE_ON_ERROR)
    def replan(*values):  # after a preset change or an applied suggestion: their message stays
        return (gr.update(), *plan_outputs(*values)[1:])

    s.preset.input(guarded(7, error_index=4)(on_preset),
                   [s.preset, s.model, s.preset_model, s.shown_preset, s.overrides, s.typed_models, s.applied],
                   [panel.card, s.model, s.preset_model, s.overrides, panel.message, s.typed_models, s.shown_preset]
                   ).then(replan, inputs, panel.plan_outputs)
    if s.algorithm is not None:
        s.algorithm.change(on_algorithm, [s.algorithm, s.overrides], s.overrides)
    if s.reward_function is not None:
        reward_inputs = [s.overrides, s.reward_function, s.reward_components]
        for box in (s.reward_function, s.reward_components):
            box.submit(guarded(2, error_index=0)(on_rewards), reward_inputs, [panel.message, s.overrides])
            box.blur(guarded(2, error_index=0)(on_rewards), reward_inputs, [panel.message, s.overrides])

    panel.plan_btn.click(on_plan, inputs, panel.plan_outputs)
    panel.apply_btn.click(guarded(3, error_index=0)(on_apply), [panel.suggestion, s.overrides, s.preset],
                          [panel.message, s.overrides, s.applied]).then(replan, inputs, panel.plan_outputs)
    panel.save_btn.click(guarded(1, error_index=0)(on_save),
                         [s.preset, s.model, s.overrides, s.preset_model, panel.yaml_path], panel.save_message)

    def on_load(*values):
        """What the page shows when it opens: the card and the plan of the current settings."""
        return (card_markdown(values[0]), *on_plan(*values))

    return on_load, inputs, [panel.card, *panel.plan_outputs]

"""The Gradio app: five tabs (Data, Plan, Train, Evaluate, Export) wired together, and its launcher.

The Plan tab owns the run settings (preset, model, overrides); the Data tab writes its dataset
choice into those overrides, the Train tab starts runs from them, and the run directory the Train
tab starts or attaches to is what the Evaluate tab chats with and the Export tab exports.
"""

from __future__ import annotations

import os

from homerlhf.errors import UserError

TITLE = "homerlhf"
START_HERE = (
    "**Start here.** To see it work, open **Train** and press *Start training*: the settings below train. "
    "For your own run, go left to right: **Data** (pick your prompts, *Use for training*) → **Plan** (does it fit "
    "your card?) → **Train** (*Start training*, watch it) → **Evaluate** (chat with it, give feedback, train on "
    "it) → **Export** (a model that runs elsewhere). Everything runs on this machine.")


def heading() -> str:
    """The page's title line: what this machine can do (a GPU found, or the CPU only)."""
    import torch

    if torch.cuda.is_available():
        return f"## {TITLE} — RLHF on one GPU ({torch.cuda.get_device_name(0)})"
    return (f"## {TITLE} — RLHF on one GPU (none found here: this machine trains on its CPU)\nThe `cpu-tiny` preset "
            "trains a tiny model on the CPU; the GPU presets plan for a card (Plan tab) and train where there is one.")


def _theme():
    import gradio as gr

    # System fonts: the default theme fetches Google Fonts, which an offline machine cannot reach.
    return gr.themes.Default(
        font=["ui-sans-serif", "system-ui", "DejaVu Sans", "sans-serif"],
        font_mono=["ui-monospace", "DejaVu Sans Mono", "monospace"],
    )


def build_app(default_preset: str = "cpu-tiny", runs_root: str = "runs"):
    """The whole app as a ``gr.Blocks`` (not launched)."""
    import gradio as gr

    import homerlhf.stages  # noqa: F401 - registers builtin:demo-sft / demo-rm, as the CLI does
    from homerlhf.app import data_tab, eval_tab, export_tab, page_load, page_settings, plan_tab, train_tab
    from homerlhf.config import preset_names

    if default_preset not in preset_names():
        raise UserError(f"unknown preset '{default_preset}'; choose one of: {', '.join(preset_names())}")
    with gr.Blocks(title=TITLE) as blocks:
        gr.Markdown(heading(), elem_id="app-heading")
        gr.Markdown(START_HERE, elem_id="app-start-here")
        active = gr.Markdown(elem_id="app-active")
        # Shared run settings: rendered inside the Plan tab, read by Data and Train.
        settings = plan_tab.settings_components(default_preset)
        run_dir_shared = gr.State("")
        with gr.Tabs(elem_id="tabs"):
            with gr.Tab("Data", id="data", elem_id="tab-data"):
                kept = data_tab.build(settings.overrides, settings.reward_function)
            with gr.Tab("Plan", id="plan", elem_id="tab-plan"):
                on_load = plan_tab.build(settings)
            with gr.Tab("Train", id="train", elem_id="tab-train"):
                train_loads = train_tab.build(settings.preset, settings.model, settings.overrides,
                                                settings.preset_model, run_dir_shared, runs_root=runs_root)
            with gr.Tab("Evaluate", id="evaluate", elem_id="tab-evaluate"):
                eval_tab.build(run_dir_shared, settings, runs_root)
            with gr.Tab("Export", id="export", elem_id="tab-export") as export_ui:
                export_tab.build(run_dir_shared, export_ui)
        # A load restores the page's settings before the plan is drawn, and attaches a run (page_load).
        page_load.wire(blocks, settings, on_load, train_loads, runs_root, kept)
        page_load.keep(settings, kept, runs_root)
        active_inputs = [settings.preset, settings.model, settings.overrides, settings.preset_model]
        for component in active_inputs[:3]:
            component.change(page_settings.active_markdown, active_inputs, active, show_progress="hidden")
        blocks.load(page_settings.active_markdown, active_inputs, active)
    return blocks


def launch(host: str = "127.0.0.1", port: int = 7860, share: bool = False, block: bool = True,
           default_preset: str = "cpu-tiny", runs_root: str = "runs"):
    """Serve the app on ``host:port`` (loopback and no share link unless asked). Returns the
    ``gr.Blocks``; with ``block=False`` it returns at once and serves in the background."""
    from homerlhf.app.data_tab import uploads_dir

    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    blocks = build_app(default_preset, runs_root)
    blocks.queue(default_concurrency_limit=4)
    try:
        blocks.launch(
            server_name=host,
            server_port=port,
            share=share,
            prevent_thread_lock=not block,
            quiet=not block,
            show_error=False,  # errors reach the page as our one-line messages, not tracebacks
            theme=_theme(),
            ssr_mode=False,
            footer_links=[],
            allowed_paths=[str(uploads_dir())],  # a kept upload, put back in the Data tab after a reload
        )
    except OSError as exc:
        reason = "the port is in use" if "empty port" in str(exc) else (exc.strerror or str(exc).splitlines()[0])
        raise UserError(f"cannot serve on {host}:{port}: {reason} (pick another --port)") from None
    return blocks

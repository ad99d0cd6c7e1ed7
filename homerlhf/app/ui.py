"""The Gradio app: five tabs (Data, Plan, Train, Evaluate, Export) wired together, and its launcher.

The Plan tab owns the run settings (preset, model, overrides); the Data tab writes its dataset
choice into those overrides, the Train tab starts runs from them, and the run directory the Train
tab starts or attaches to is what the Evaluate tab chats with and the Export tab exports.
"""

from __future__ import annotations

import os

from homerlhf.errors import UserError

TITLE = "homerlhf — RLHF on one GPU"


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
    from homerlhf.app import data_tab, eval_tab, export_tab, page_load, plan_tab, train_tab
    from homerlhf.config import preset_names

    if default_preset not in preset_names():
        raise UserError(f"unknown preset '{default_preset}'; choose one of: {', '.join(preset_names())}")
    with gr.Blocks(title=TITLE) as blocks:
        gr.Markdown(f"## {TITLE}\nData → Plan → Train → Evaluate → Export. Everything runs on this machine.")
        # Shared run settings: rendered inside the Plan tab, read by Data and Train.
        settings = plan_tab.settings_components(default_preset)
        run_dir_shared = gr.State("")
        with gr.Tabs(elem_id="tabs"):
            with gr.Tab("Data", id="data", elem_id="tab-data"):
                data_tab.build(settings.overrides, settings.reward_function)
            with gr.Tab("Plan", id="plan", elem_id="tab-plan"):
                on_load = plan_tab.build(settings)
            with gr.Tab("Train", id="train", elem_id="tab-train"):
                train_loads = train_tab.build(settings.preset, settings.model, settings.overrides,
                                                settings.preset_model, run_dir_shared, runs_root=runs_root)
            with gr.Tab("Evaluate", id="evaluate", elem_id="tab-evaluate"):
                eval_tab.build(run_dir_shared, settings, runs_root)
            with gr.Tab("Export", id="export", elem_id="tab-export") as export_ui:
                export_tab.build(run_dir_shared, export_ui)
        # A load restores a running run's settings before the plan is drawn, and attaches a run (page_load).
        page_load.wire(blocks, settings, on_load, train_loads, runs_root)
    return blocks


def launch(host: str = "127.0.0.1", port: int = 7860, share: bool = False, block: bool = True,
           default_preset: str = "cpu-tiny", runs_root: str = "runs"):
    """Serve the app on ``host:port`` (loopback and no share link unless asked). Returns the
    ``gr.Blocks``; with ``block=False`` it returns at once and serves in the background."""
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
        )
    except OSError as exc:
        reason = "the port is in use" if "empty port" in str(exc) else (exc.strerror or str(exc).splitlines()[0])
        raise UserError(f"cannot serve on {host}:{port}: {reason} (pick another --port)") from None
    return blocks

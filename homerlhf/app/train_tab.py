"""The Train tab: start a run as a detached ``homerlhf train`` process, stop it, attach to a run
directory, and watch it live (plots, progress with ETA, latest samples, worker status, log)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from homerlhf.app import audit_panel, feedback_runs, history_panel, monitor, monitor_reference, runs
from homerlhf.app.common import guarded, md_text, toast
from homerlhf.app.plan_tab import run_overrides
from homerlhf.app.run_controls import (  # noqa: F401 - the tab's API
    on_kill, on_resume, on_stop, resume_argv, with_iterations)
from homerlhf.app.train_status import (  # noqa: F401 (worker_table and the rest: the tab's, re-exported)
    default_run_dir, holds_run, is_default_run_dir, status_markdown, total_iterations, worker_table,
)
from homerlhf.errors import UserError

POLL_S = 2.0
# The events that draw the monitor run one at a time, in the order sent: a poll that read the run before a
# Start is sent before the Start clears it, or runs after it and draws nothing (refresh). Handlers run in
# threads and each sends its result when done, so without this a poll that checked before the Start could
# be sent after the cleared monitor. The page still applies each result as its own task, so Start's own
# reply (on_start), sent last, writes the status line of the run it started.
MONITOR = {"concurrency_id": "train-monitor", "concurrency_limit": 1}


NO_RUN = "No run attached: start one or attach to a run directory."


def poll(run_dir: str, last_n: int = -1) -> tuple:
    """Everything the monitor shows for ``run_dir``: (status md, progress md, figure, samples,
    workers, log, n_rows, state). The figure and samples are None when the row count is still
    ``last_n`` (nothing new to draw)."""
    if not run_dir:
        return (NO_RUN, "", None, [], [], "", 0, "")
    path = Path(run_dir)
    status = runs.run_status(path)
    rows = monitor.read_jsonl(path / runs.METRICS_FILE)
    preference = feedback_runs.is_preference_run(path, status.argv)  # a DPO / KTO run: optimizer steps
    total = feedback_runs.total_steps(path, rows) if preference else total_iterations(path, status.argv)
    prog = monitor.progress(rows, total, started_at=status.started_at,
                            now=status.ended_at if status.ended_at and not status.running else None)
    if status.state in ("stopped", "crashed", "finished"):
        prog.eta_s = None  # no time is left to estimate (a run started elsewhere may still be going)
    changed = len(rows) != last_n
    figure = None
    if changed:  # beside a run of the demo's task, a healthy demo run's lines (monitor_reference)
        figure = (feedback_runs.preference_figure(rows) if preference
                  else monitor.metrics_figure(rows, monitor_reference.for_run(path)))
    samples = monitor.latest_samples(monitor.read_jsonl(path / runs.SAMPLES_FILE, last=50)) if changed else None
    line = prog.line().replace("iteration", "step", 1) if preference else prog.line()
    return (status_markdown(status), f"**Progress:** {line}", figure, samples,
            worker_table(path, status), monitor.quiet_log(status.log_tail)[-3000:], len(rows), status.state)


@dataclass
class TrainPanel:
    """The tab's components: run controls, the monitor, and the state of the attached run."""

    run_dir: Any
    overwrite: Any
    command: Any
    start_btn: Any
    stop_btn: Any
    kill_btn: Any
    resume_btn: Any
    iterations: Any  # Number: ppo.iterations of the next Start, written into the Plan tab's overrides
    runs_dd: Any
    refresh_btn: Any
    attach_btn: Any
    message: Any
    status_md: Any
    progress_md: Any
    plot: Any
    plot_caption: Any
    samples: Any
    workers: Any
    log_box: Any
    attached: Any  # gr.State: the run directory being watched
    n_rows: Any  # gr.State: metrics rows drawn so far (-1: redraw; PAUSED: a Start is under way)
    state: Any  # gr.State: the attached run's state at the last poll ("running", "crashed", ...)
    timer: Any
    starts: Any  # gr.State: the Starts pressed on this page (see refresh)
    history: Any = None  # the Sample history (history_panel.HistoryPanel)
    audit: Any = None  # the audit verdict (audit_panel.layout)

    @property
    def monitor_outputs(self) -> list:
        return [self.status_md, self.progress_md, self.plot, self.samples, self.workers, self.log_box, self.n_rows,
                self.state, self.message]


COMMAND_LABEL = "What Start training runs: a new run of the Plan tab's settings"
PAUSED = -2  # n_rows while a Start is under way: the timer leaves the cleared monitor alone
STOPPING = "stopping"  # the state after Stop or Force stop until the run ends: their reply stays in the message
SAMPLE_WIDTHS = ["120px", "30%", "50%", "100px"]  # iteration and score always in view (1400 px wide)


def _layout(runs_root: str) -> TrainPanel:
    import gradio as gr

    with gr.Row():
        iterations = gr.Number(label="Iterations", precision=0, scale=1, elem_id="train-iterations",
                               info="How long it trains: rounds of sample, score, update (ppo.iterations)")
        run_dir = gr.Textbox(default_run_dir(runs_root), label="Run directory", scale=3, elem_id="train-run-dir",
                             info="A new runs/app-<time> for each Start unless you type one")
        overwrite = gr.Checkbox(False, label="Overwrite an old run there", elem_id="train-overwrite")
    command = gr.Code(label=COMMAND_LABEL, language="shell", interactive=False, lines=2, elem_id="train-command")
    with gr.Row():
        start_btn = gr.Button("Start training", variant="primary", elem_id="train-start")
        stop_btn = gr.Button("Stop (checkpoint first)", variant="stop", elem_id="train-stop")
        kill_btn = gr.Button("Force stop (no checkpoint)", elem_id="train-kill")
        resume_btn = gr.Button("Resume", elem_id="train-resume")
    with gr.Row():
        runs_dd = gr.Dropdown([], label="Existing runs", allow_custom_value=True, scale=3, elem_id="train-runs")
        refresh_btn = gr.Button("Refresh list", elem_id="train-refresh")
        attach_btn = gr.Button("Attach", elem_id="train-attach")
    message = gr.Markdown(elem_id="train-message")
    status_md = gr.Markdown(NO_RUN, elem_id="train-status")
    progress_md = gr.Markdown(elem_id="train-progress")
    # Interactive panels (plotly: hover for values, drag to zoom); their titles and legends stay text.
    plot = gr.Plot(label="Metrics", show_label=False, elem_id="train-plot")
    with gr.Accordion("Metric names", open=False):
        plot_caption = gr.Markdown(monitor.caption_markdown(), elem_id="train-plot-caption")
    audit = audit_panel.layout()
    samples = gr.Dataframe(headers=["iteration", "prompt", "response", "score"], label="Latest samples",
                           wrap=True, interactive=False, column_widths=SAMPLE_WIDTHS, elem_id="train-samples")
    history = history_panel.layout()
    workers = gr.Dataframe(headers=["role", "backend", "url", "status", "latency ms"], label="Workers",
                           interactive=False, elem_id="train-workers")
    with gr.Accordion("Training log (tail)", open=False):
        log_box = gr.Textbox(lines=12, max_lines=30, show_label=False, elem_id="train-log")
    return TrainPanel(run_dir, overwrite, command, start_btn, stop_btn, kill_btn, resume_btn, iterations,
                      runs_dd, refresh_btn, attach_btn,
                      message, status_md, progress_md, plot, plot_caption, samples, workers, log_box,
                      attached=gr.State(""), n_rows=gr.State(-1), state=gr.State(""), timer=gr.Timer(POLL_S),
                      starts=gr.State(0), history=history, audit=audit)


def describe_attached(run_dir: str) -> tuple:
    """What names the attached run's lines (*Metric names*: PPO's, or a DPO / KTO run's) and what *Start* would
    start beside it (always a new PPO run, also while a feedback run from Evaluate is attached)."""
    import gradio as gr

    argv = runs.run_status(run_dir).argv if run_dir else []
    if not (run_dir and feedback_runs.is_preference_run(run_dir, argv)):
        return monitor.caption_markdown(), gr.update(label=COMMAND_LABEL)
    method = (argv[0] if argv[:1] and argv[0] in ("dpo", "kto") else
              (feedback_runs.info_of(run_dir) or {}).get("method", "DPO / KTO")).upper()
    return feedback_runs.caption_markdown(), gr.update(
        label=f"What Start training runs: a new PPO run of the Plan tab's settings (the run attached is a {method} run)")


def show_command(preset, model, overrides, preset_model, run_dir, overwrite) -> str:
    """The ``homerlhf train`` command the Start button runs (or the reason there is none)."""
    try:
        items = run_overrides(model, overrides, preset_model)
    except UserError as exc:
        return f"# {exc}"
    return runs.format_command(runs.train_argv(preset, run_dir, None, items, overwrite), multiline=True)


def refresh(run_dir, last_n, last_state="", starts=0, request=None):
    """The monitor's outputs for ``run_dir`` (``monitor_outputs``); the plot and samples stay as they
    are without a new row. When the run ends, the Start line goes (the status says how it ended) and
    a crash shows its reason in a toast too; after Stop or Force stop (``STOPPING``) their reply stays, also
    once the run has ended. ``starts``: the Starts this page had pressed when the poll
    was sent; a poll sent or still running when another Start was pressed draws nothing (``request``:
    Gradio's, naming the page)."""
    import gradio as gr

    nothing = (gr.update(),) * 9  # the rows drawn and the state too: a Start may have set them meanwhile
    if last_n == PAUSED or (not run_dir and last_n != -1):
        return nothing
    out = list(poll(run_dir, last_n))
    if request is not None and _starts_pressed(request) != starts:  # checked after the poll: a Start may come while it reads
        return nothing
    keep = gr.update()
    if run_dir and out[2] is None:
        out[2], out[3] = keep, keep
    if last_state == STOPPING and out[7] == "running":
        out[7] = STOPPING
    message = keep
    if last_state == "running" and out[7] != "running":
        message = ""
        if out[7] == "crashed":
            toast(f"The run crashed: {runs.run_status(run_dir).message()}")
    return (*out, message)


# Starts, Attaches and Stops pressed per page (Gradio session): a poll sent before the last one, or still reading
# when it came, draws nothing (cancelling the timer's pending event does not stop one already sent).
_STARTS: dict[str, int] = {}


def _starts_pressed(request) -> int:
    return _STARTS.get(getattr(request, "session_hash", None) or "", 0)


def new_watch(request=None) -> int:
    """A Start or an Attach: this page's count goes up, so polls sent before it draw nothing (refresh)."""
    key = getattr(request, "session_hash", None) or ""
    _STARTS[key] = _STARTS.get(key, 0) + 1
    return _STARTS[key]


def pause_monitor(request=None):
    """The monitor cleared at once when Start is pressed: never the previous run's plot under the new one.
    Returns ``monitor_outputs`` and this page's count of Starts."""
    return ("Starting a run…", "", None, [], [], "", PAUSED, "", "", new_watch(request))


def redraw(run_dir, last_n, last_state="", starts=0, request=None):
    """After an Attach: the attached run drawn whatever rows count a poll left behind."""
    return refresh(run_dir, -1, last_state, starts, request)


NO_PROMPTS_HERE = ("no prompts to train on: load yours in the Data tab (a file, a folder or a hub id) and press "
                   "'Use for training', which writes data.prompts into the overrides")


def on_start(preset, model, overrides, preset_model, run_dir, overwrite, runs_root: str = "runs") -> tuple:
    """Start ``homerlhf train`` as its own process: (message, attached, shared run dir, run dir box,
    rows drawn, state, status line of the run started: see ``MONITOR``). A default ``runs/app-<time>``
    that already holds a run gives way to a fresh one; a directory the user typed is never replaced."""
    from homerlhf.config import NO_PROMPTS, check_train, load_config
    from homerlhf.stages.preflight import check_run

    text = (run_dir or "").strip()
    path = Path(text) if text else Path(default_run_dir(runs_root))
    if not overwrite and runs.is_run_dir(path) and is_default_run_dir(str(path), runs_root):
        path = Path(default_run_dir(runs_root))
    feedback_runs.refuse_if_running([runs_root, path.parent])  # one run at a time, named
    items = run_overrides(model, overrides, preset_model)
    cfg = load_config(preset, None, items)
    try:
        check_train(cfg)  # no prompts, no GPU: reported here, all at once, not as a crashed run
    except UserError as exc:
        raise UserError(str(exc).replace(NO_PROMPTS, NO_PROMPTS_HERE)) from None
    check_run(cfg)  # models the backends cannot serve, a model that is nowhere: likewise
    if holds_run(path) and not overwrite:
        raise UserError(f"{path} already holds a run; tick 'Overwrite', pick another dir, or Attach to it")
    status = runs.start_run(path, runs.train_argv(preset, path, None, items, overwrite))
    return (f"Started: {md_text(status.message())}", str(path), str(path), str(path), -1, "running",
            status_markdown(status))


def runs_list(run_dir: str, runs_root: str):
    """The Existing runs dropdown: the runs beside ``run_dir`` and under ``runs_root``, ``run_dir`` selected."""
    import gradio as gr

    found = known_runs(run_dir, runs_root)
    return gr.update(choices=found, value=run_dir if run_dir in found else (found[0] if found else None))


def attach_choice(choice: str, typed: str, attached: str) -> str:
    """What *Attach* attaches: the *Existing runs* pick, or (when that is still the attached run) a run
    directory typed in the *Run directory* box instead."""
    typed = (typed or "").strip()
    if (not choice or choice == attached) and typed and typed != attached and runs.is_run_dir(Path(typed)):
        return typed
    return choice


def on_attach(choice, typed: str = "", attached: str = "") -> tuple:
    """Watch an existing run (:func:`attach_choice`): (message, attached, shared run dir, rows drawn = -1 to
    redraw, run dir box, state)."""
    choice = attach_choice(choice, typed, attached)
    if not (choice or "").strip():
        raise UserError("pick a run from the list (Refresh list) or type its directory")
    path = Path(choice.strip())
    if not path.is_dir():
        raise UserError(f"no run directory at '{choice}'; pick one from the list or type a path")
    if not runs.is_run_dir(path):
        raise UserError(f"{path} holds no run (no metrics.jsonl, checkpoints or config)")
    return f"Attached to `{path}`.", str(path), str(path), -1, str(path), runs.run_status(path).state


def known_runs(run_dir: str, runs_root: str) -> list[str]:
    """Run directories beside ``run_dir`` and under ``runs_root``, without repeats."""
    found: list[str] = []
    for root in (Path(run_dir).parent if run_dir else None, Path(runs_root)):
        if root is not None:
            found += [str(p) for p in runs.list_runs(root) if str(p) not in found]
    return found


def on_page_load(runs_root: str) -> tuple:
    """A page opened or reloaded: the Existing runs list, and the newest running run attached and drawn
    (else a fresh run directory): (runs list, attached, shared run dir, run dir box, *monitor outputs)."""
    import gradio as gr

    found = known_runs("", runs_root)
    running = next((p for p in found if runs.run_status(p).running), None)
    listed = gr.update(choices=found, value=running or (found[0] if found else None))
    if running is None:
        return (listed, "", "", default_run_dir(runs_root), *refresh("", -1, ""))
    monitor_out = list(refresh(running, -1, "running"))
    monitor_out[-1] = f"Re-attached to the running run `{running}`."
    return (listed, running, running, running, *monitor_out)


def follow_shared(shared, attached, starts=0, request=None) -> tuple:
    """The run the other tabs share moved (Evaluate started a feedback run): the monitor attaches to it and
    draws it. Returns (attached, run dir box, *monitor outputs); nothing at all when it is the attached one."""
    import gradio as gr

    if not shared or shared == attached:
        return (gr.update(),) * 11
    out = list(refresh(shared, -1, runs.run_status(shared).state, starts, request))
    out[-1] = f"Attached to `{shared}`."
    return (shared, shared, *out)


def stop_pressed(run_dir, request=None) -> tuple:
    """Stop: the reply, the ``STOPPING`` state, and this page's count of watches up (a poll sent before it,
    which still thinks the run is running, would take the reply away when it sees the run ended)."""
    return on_stop(run_dir), STOPPING, new_watch(request)


def kill_pressed(run_dir, request=None) -> tuple:
    """Force stop, as :func:`stop_pressed`."""
    return on_kill(run_dir), STOPPING, new_watch(request)


def _wire_runs(panel: TrainPanel, cmd_inputs: list, run_dir_shared, runs_root: str, tick) -> None:
    """Start, stop, list and attach; each start or attach redraws the monitor. A Start cancels a poll
    (``tick``) not yet run, which would draw the run before it over the cleared monitor."""

    @guarded(8, error_index=0, on_error={4: -1})  # a failed Start redraws the run that was attached
    def start(preset, model, overrides, preset_model, run_dir, overwrite, iterations):
        overrides = with_iterations(iterations, preset, model, overrides, preset_model)  # the field as shown
        return (*on_start(preset, model, overrides, preset_model, run_dir, overwrite, runs_root), overrides)

    monitor_inputs = [panel.attached, panel.n_rows, panel.state, panel.starts]
    overrides_box = cmd_inputs[2]
    panel.start_btn.click(pause_monitor, None, [*panel.monitor_outputs, panel.starts], cancels=[tick],
                          **MONITOR).then(
        start, [*cmd_inputs, panel.iterations],
        [panel.message, panel.attached, run_dir_shared, panel.run_dir, panel.n_rows, panel.state, panel.status_md,
         overrides_box], **MONITOR
    ).then(refresh, monitor_inputs, panel.monitor_outputs, **MONITOR).then(
        lambda run_dir: runs_list(run_dir, runs_root), panel.attached, panel.runs_dd)
    panel.resume_btn.click(pause_monitor, None, [*panel.monitor_outputs, panel.starts], cancels=[tick],
                           **MONITOR).then(
        guarded(5, error_index=0, on_error={3: -1})(lambda run_dir: on_resume(run_dir, runs_root)), panel.attached,
        [panel.message, panel.attached, run_dir_shared, panel.n_rows, panel.state]
    ).then(refresh, monitor_inputs, panel.monitor_outputs, **MONITOR)
    for button, handler in ((panel.stop_btn, stop_pressed), (panel.kill_btn, kill_pressed)):
        button.click(guarded(3, error_index=0)(handler), panel.attached, [panel.message, panel.state, panel.starts],
                     **MONITOR)

    panel.refresh_btn.click(lambda run_dir: runs_list(run_dir, runs_root), panel.run_dir, panel.runs_dd)
    panel.attach_btn.click(new_watch, None, panel.starts, cancels=[tick], **MONITOR).then(
        guarded(6, error_index=0)(on_attach), [panel.runs_dd, panel.run_dir, panel.attached],
        [panel.message, panel.attached, run_dir_shared, panel.n_rows, panel.run_dir, panel.state]
    ).then(redraw, monitor_inputs, panel.monitor_outputs, **MONITOR)


def build(preset, model, overrides, preset_model_state, run_dir_shared, runs_root: str = "runs") -> list[tuple]:
    """Lay out the tab; ``preset``/``model``/``overrides`` are the Plan tab's components.
    Returns the page's load events as (handler, inputs, outputs): the command, and the runs list with
    the running run re-attached."""
    import gradio as gr

    gr.Markdown("### Train\nStarts `homerlhf train` as its own process: closing the browser or the app "
                "never stops it. Stop asks it to save a checkpoint, then exit.")
    from homerlhf.app.page_settings import iterations_of

    panel = _layout(runs_root)
    cmd_inputs = [preset, model, overrides, preset_model_state, panel.run_dir, panel.overwrite]
    for comp in (preset, model, overrides, panel.run_dir, panel.overwrite):
        comp.change(show_command, cmd_inputs, panel.command)
    settings_inputs = cmd_inputs[:4]
    for comp in (preset, model, overrides):
        comp.change(iterations_of, settings_inputs, panel.iterations, show_progress="hidden")
    def typed(n, *values):  # the field into the overrides (unchanged when they give that length already)
        return "", with_iterations(n, *values)

    for event in (panel.iterations.submit, panel.iterations.blur):
        event(guarded(2, error_index=0)(typed), [panel.iterations, *settings_inputs], [panel.message, overrides])
    for handler in (refresh, pause_monitor, follow_shared, new_watch, redraw, stop_pressed, kill_pressed):  # Gradio hands its request to a parameter annotated so
        handler.__annotations__["request"] = gr.Request
    monitor_inputs = [panel.attached, panel.n_rows, panel.state, panel.starts]
    tick = panel.timer.tick(refresh, monitor_inputs, panel.monitor_outputs, show_progress="hidden", **MONITOR)
    history_panel.wire(panel.history, panel.attached, panel.timer)
    audit_panel.wire(panel.audit, panel.attached, panel.timer)
    _wire_runs(panel, cmd_inputs, run_dir_shared, runs_root, tick)
    panel.attached.change(describe_attached, panel.attached, [panel.plot_caption, panel.command], show_progress="hidden")
    run_dir_shared.change(follow_shared, [run_dir_shared, panel.attached, panel.starts],
                          [panel.attached, panel.run_dir, *panel.monitor_outputs], show_progress="hidden",
                          **MONITOR)
    def reattach():
        return on_page_load(runs_root)

    return [(reattach, None, [panel.runs_dd, panel.attached, run_dir_shared, panel.run_dir, *panel.monitor_outputs]),
            (show_command, cmd_inputs, panel.command), (iterations_of, settings_inputs, panel.iterations)]

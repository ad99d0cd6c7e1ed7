"""The Export tab: a run's trained policy as a model that runs elsewhere (`homerlhf export policy`).

Pick a run and a checkpoint (named as the Evaluate tab names it, or ``best``), the base weights, the
dtype and GGUF types, export with a progress bar (the merge and each GGUF's tensors, through Gradio's
tqdm tracking), then see the written files and the commands that run them (transformers, llama.cpp,
Ollama). The work is :mod:`homerlhf.stages.export`'s; this module only lays out and reports, and
says its refusals in the tab's own field names, not the CLI's flags.
"""

from __future__ import annotations

import re
from pathlib import Path

from homerlhf.app import runs
from homerlhf.app.common import guarded
from homerlhf.errors import UserError

DEFAULT_TYPES = ["q4_k_m"]
BEST = ("best (the highest mean score)", "best")
DTYPE_FLAGS = ("fp32", "bf16", "fp16")


def checkpoint_choices(run_dir: str) -> list[tuple[str, str]]:
    """(label, value): the run's checkpoints newest first, labelled as every tab labels them
    (:func:`homerlhf.app.runs.checkpoint_entries`: ``iter_000003``, one whose actor adapter is not what
    its manifest recorded marked with why; its export is refused), valued by iteration; then ``best``."""
    from homerlhf.ppo.checkpoint import POLICY_FILES

    entries = runs.checkpoint_entries(run_dir, POLICY_FILES)
    if not entries:
        return []
    return [*[(label, str(int(path.name.split("_")[1]))) for label, path in entries], BEST]


def default_checkpoint(choices: list[tuple[str, str]]):
    """The newest checkpoint not marked unusable (else the newest; None for none), as Evaluate picks it."""
    usable = [value for label, value in choices if value != BEST[1] and re.fullmatch(r"iter_\d+", label)]
    return (usable or [value for _, value in choices] or [None])[0]


def default_out(run_dir: str) -> str:
    """``RUNS/exports/RUN``: beside the runs, named after the run (the GGUF files and the Ollama model too)."""
    return str(Path(run_dir).parent / "exports" / Path(run_dir).name) if run_dir else ""


def compute_flag(run_dir: str) -> str:
    """The dtype the run's policy computed in, as ``--dtype`` names it (``fp32`` for a CPU run); '' unknown."""
    from homerlhf.stages.export_plan import FLAGS, compute_dtype_name

    cfg = runs.run_config(run_dir) if run_dir else None
    newest = runs.list_checkpoints(run_dir) if run_dir and cfg is None else []
    if newest and (newest[0] / "config.yaml").is_file():  # a DPO / KTO run keeps its config per checkpoint
        from homerlhf.config import from_yaml_file

        cfg = from_yaml_file(newest[0] / "config.yaml")
    if cfg is None:
        return ""
    try:
        name = compute_dtype_name(cfg)
    except (UserError, ValueError):
        return ""
    return FLAGS.get(name, name)


def dtype_choices(run_dir: str) -> list[tuple[str, str]]:
    """The 'Save in' choices: ``auto`` (the dtype the policy computed in, named once the run is known),
    then each dtype ``homerlhf export policy --dtype`` takes."""
    flag = compute_flag(run_dir)
    auto = f"as the policy computed ({flag})" if flag else "as the policy computed"
    return [(auto, "auto"), *[(f, f) for f in DTYPE_FLAGS]]


# The CLI's flags in export's messages, as this tab's fields (specific phrases first).
FIELD_WORDS = [
    (r"pass --overwrite to replace it or choose another --out", "tick 'Overwrite' to replace it, or choose another 'Output directory'"),
    (r"give the --out of a `homerlhf train` run", "give the directory of a run (the Train tab's, or one `homerlhf train` wrote)"),
    (r"with --checkpoint \d+", "(pick it in 'Checkpoint')"),
    (r"\(or pass last or best\)", "(or pick best)"),
    (r"pass last or an iteration number", "pick a checkpoint of the list"),
    (r"give an iteration number \(([^)]*)\), last or best", r"pick one of the list (iterations \1) or best"),
    (r"or leave it out for the dtype the policy computed in", "or 'as the policy computed'"),
    (r"--private makes sense only with --push-to-hub REPO", "'Private' makes sense only with 'Upload to repo' filled"),
    (r"unset it or drop --push-to-hub", "unset it or empty 'Upload to repo'"),
    (r"--push-to-hub", "'Upload to repo'"),
    (r"--private", "'Private'"),
    (r"--checkpoint", "'Checkpoint'"),
    (r"--overwrite", "'Overwrite'"),
    (r"--out\b", "'Output directory'"),
    (r"--base", "'Merge into'"),
    (r"--dtype", "'Save in'"),
    (r"--gguf", "'GGUF types'"),
]


def app_words(message: str) -> str:
    """``message`` (export's, written for the CLI) with each flag replaced by the field that sets it here."""
    for pattern, field in FIELD_WORDS:
        message = re.sub(pattern, field, message)
    return message


def _size(path: Path) -> str:
    n = path.stat().st_size
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def result_markdown(result: dict) -> str:
    """What was written, the measured gap, and how to run it."""
    out, gap = Path(result["out"]), result["gap"]
    verdict = ("the trained policy up to rounding" if result["base"] == "nf4"
               else "**not** the trained policy: merged into the original weights")
    lines = [f"**Exported** `{out}` from `{Path(result['checkpoint']).name}` (base {result['base']}, {result['dtype']}): "
             f"max |Δ log p| {gap['max_abs']:.1e}, mean {gap['mean_abs']:.1e} nats/token on {gap['tokens']} held "
             f"tokens — {verdict}.", "", "| file | size |", "|---|---|"]
    if result.get("rounding"):
        lines[0] += f" Note: {app_words(result['rounding'])}."
    lines += [f"| `{rel}` | {_size(out / rel)} |" for rel in result["files"] if (out / rel).is_file()]
    lines += [f"- {g['tensors']}" for g in result["gguf"]]
    if result.get("hub_url"):
        lines.append(f"- uploaded to {result['hub_url']}")
    lines += ["", "Run it:", "", "```bash", *result["commands"], "```"]
    return "\n".join(lines)


def on_export(run_dir, checkpoint, out, base, types, overwrite, hub_repo, private, progress=None, dtype="auto"):
    """Checks, exports and reports; every mistake is the CLI's one line, in this tab's field names."""
    from homerlhf.stages.export import plan_policy_export, run_policy_export

    if not run_dir:
        raise UserError("give a run directory (or start/attach one in the Train tab)")
    if not out:
        raise UserError("give an 'Output directory'")
    try:
        plan = plan_policy_export(run_dir, out, checkpoint=checkpoint or "last", base=base, gguf=list(types or []),
                                  push_to_hub=(hub_repo or "").strip() or None, private=bool(private),
                                  overwrite=bool(overwrite), dtype=dtype or "auto")
        report = (lambda fraction, what: progress(fraction, desc=what)) if progress is not None else None
        return result_markdown(run_policy_export(plan, report))
    except UserError as exc:
        raise UserError(app_words(str(exc))) from None


def fill(run: str, current, out: str, dtype: str) -> tuple:
    """The checkpoint list, output dir and dtype choices of ``run``: (checkpoint, out, dtype) updates. The
    checkpoint picked stays picked while the run has it; an output dir typed stays."""
    import gradio as gr

    choices = checkpoint_choices(run)
    values = [value for _, value in choices]
    value = current if current in values else default_checkpoint(choices)
    return (gr.update(choices=choices, value=value), out or default_out(run),
            gr.update(choices=dtype_choices(run), value=dtype or "auto"))


def build(run_dir_shared, tab=None) -> None:
    """Lay out the tab; ``tab``: its ``gr.Tab``, whose opening fills the checkpoint list."""
    import gradio as gr

    from homerlhf.workers.gguf.policy import POLICY_GGUF_TYPES

    gr.Markdown("### Export\nTurn a checkpoint into a model that runs without homerlhf: a folder that transformers "
                "loads, GGUF files for llama.cpp, Ollama and LM Studio (with an Ollama Modelfile each), and a model "
                "card saying how it was trained. It is the model you trained and chatted with in Evaluate: the export "
                "measures how close its answers' probabilities are and shows the gap. "
                "`homerlhf export policy` does the same in a terminal; docs/export.md has the details.")
    with gr.Row():
        run_dir = gr.Textbox(label="Run directory", scale=3, elem_id="export-run-dir")
        checkpoint = gr.Dropdown([], label="Checkpoint", allow_custom_value=True, scale=1, elem_id="export-checkpoint")
        refresh = gr.Button("Refresh checkpoints", elem_id="export-refresh")
    with gr.Row():
        out = gr.Textbox(label="Output directory", scale=3, elem_id="export-out")
        base = gr.Radio([("what it trained on (nf4)", "nf4"), ("the original weights", "original")], value="nf4",
                        label="Merge into", elem_id="export-base",
                        info="nf4 is your trained model; the original is close to it, not the same")
        dtype = gr.Radio(dtype_choices(""), value="auto", label="Save in", elem_id="export-dtype",
                         info="the merged model's dtype; rounding off the policy's costs a measured gap")
        overwrite = gr.Checkbox(False, label="Overwrite", elem_id="export-overwrite")
    types = gr.CheckboxGroup(list(POLICY_GGUF_TYPES), value=DEFAULT_TYPES, label="GGUF types", elem_id="export-gguf")
    with gr.Accordion("Hugging Face Hub (uses HF_TOKEN or `hf auth login`)", open=False):
        with gr.Row():
            hub_repo = gr.Textbox(label="Upload to repo (empty: no upload)", elem_id="export-hub-repo")
            private = gr.Checkbox(False, label="Private", elem_id="export-private")
    export_btn = gr.Button("Export", variant="primary", elem_id="export-start")
    result = gr.Markdown(elem_id="export-result")

    def sync(run, current_dtype):  # a run attached in the Train tab: its list (newest usable), its own output dir
        return run, *fill(run, None, "", current_dtype)

    run_dir_shared.change(sync, [run_dir_shared, dtype], [run_dir, checkpoint, out, dtype])
    refresh.click(fill, [run_dir, checkpoint, out, dtype], [checkpoint, out, dtype])
    run_dir.submit(fill, [run_dir, checkpoint, out, dtype], [checkpoint, out, dtype])
    if tab is not None:  # the list as it is when the tab opens: checkpoints written since the attach show

        def on_open(run, shared, current, current_out, current_dtype):
            run = run or shared
            return run, *fill(run, current, current_out, current_dtype)

        tab.select(on_open, [run_dir, run_dir_shared, checkpoint, out, dtype], [run_dir, checkpoint, out, dtype])

    @guarded(1, error_index=0)
    def export(run, ckpt, out_dir, base_choice, gguf, replace, repo, is_private, save_in,
               progress=gr.Progress(track_tqdm=True)):
        return on_export(run, ckpt, out_dir, base_choice, gguf, replace, repo, is_private, progress, save_in)

    export_btn.click(export, [run_dir, checkpoint, out, base, types, overwrite, hub_repo, private, dtype], result)

"""The Export tab: a run's trained policy as a model that runs elsewhere (`homerlhf export policy`).

Pick a run and a checkpoint (an iteration, ``last`` or ``best``), the base weights and GGUF types,
export with a progress bar (the merge and each GGUF's tensors, through Gradio's tqdm tracking),
then see the written files and the commands that run them (transformers, llama.cpp, Ollama).
The work is :mod:`homerlhf.stages.export`'s; this module only lays out and reports.
"""

from __future__ import annotations

from pathlib import Path

from homerlhf.app import runs
from homerlhf.app.common import guarded
from homerlhf.errors import UserError

DEFAULT_TYPES = ["q4_k_m"]


def checkpoint_choices(run_dir: str) -> list[tuple[str, str]]:
    """(label, value): ``last``, ``best`` and the run's checkpoint iterations, newest first; one whose
    actor adapter is not what its manifest recorded is marked with why (its export is refused)."""
    from homerlhf.ppo.checkpoint import POLICY_FILES

    states = runs.checkpoint_states(run_dir, POLICY_FILES) if run_dir else []
    if not states:
        return []
    numbers = [(str(int(p.name.split("_")[1])), problem) for p, problem in states]
    return [(runs.checkpoint_label("last", states[0][1]), "last"), ("best", "best"),
            *[(runs.checkpoint_label(n, problem), n) for n, problem in numbers]]


def default_out(run_dir: str) -> str:
    """``RUNS/exports/RUN``: beside the runs, named after the run (the GGUF files and the Ollama model too)."""
    return str(Path(run_dir).parent / "exports" / Path(run_dir).name) if run_dir else ""


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
    lines += [f"| `{rel}` | {_size(out / rel)} |" for rel in result["files"] if (out / rel).is_file()]
    lines += [f"- {g['tensors']}" for g in result["gguf"]]
    if result.get("hub_url"):
        lines.append(f"- uploaded to {result['hub_url']}")
    lines += ["", "Run it:", "", "```bash", *result["commands"], "```"]
    return "\n".join(lines)


def on_export(run_dir, checkpoint, out, base, types, overwrite, hub_repo, private, progress=None):
    """Checks, exports and reports; every mistake is the one line the CLI gives."""
    from homerlhf.stages.export import plan_policy_export, run_policy_export

    if not run_dir:
        raise UserError("give a run directory (or start/attach one in the Train tab)")
    if not out:
        raise UserError("give an output directory")
    plan = plan_policy_export(run_dir, out, checkpoint=checkpoint or "last", base=base, gguf=list(types or []),
                              push_to_hub=(hub_repo or "").strip() or None, private=bool(private),
                              overwrite=bool(overwrite))
    report = (lambda fraction, what: progress(fraction, desc=what)) if progress is not None else None
    return result_markdown(run_policy_export(plan, report))


def build(run_dir_shared) -> None:
    import gradio as gr

    from homerlhf.workers.gguf.policy import POLICY_GGUF_TYPES

    gr.Markdown("### Export\nThe checkpoint's actor merged into the dequantized NF4 base it trained on (the "
                "trained policy, up to the rounding of the dtype it computed in), as a transformers model, GGUFs "
                "for llama.cpp / Ollama / LM Studio (quantized by llama.cpp) with an Ollama Modelfile each, and a model card. "
                "`homerlhf export policy` does the same; docs/export.md has the details.")
    with gr.Row():
        run_dir = gr.Textbox(label="Run directory", scale=3, elem_id="export-run-dir")
        checkpoint = gr.Dropdown([], label="Checkpoint", allow_custom_value=True, scale=1, elem_id="export-checkpoint")
        refresh = gr.Button("Refresh checkpoints", elem_id="export-refresh")
    with gr.Row():
        out = gr.Textbox(label="Output directory", scale=3, elem_id="export-out")
        base = gr.Radio(["nf4", "original"], value="nf4", label="Merge into", elem_id="export-base")
        overwrite = gr.Checkbox(False, label="Overwrite", elem_id="export-overwrite")
    types = gr.CheckboxGroup(list(POLICY_GGUF_TYPES), value=DEFAULT_TYPES, label="GGUF types", elem_id="export-gguf")
    with gr.Accordion("Hugging Face Hub (uses HF_TOKEN or `hf auth login`)", open=False):
        with gr.Row():
            hub_repo = gr.Textbox(label="Upload to repo (empty: no upload)", elem_id="export-hub-repo")
            private = gr.Checkbox(False, label="Private", elem_id="export-private")
    export_btn = gr.Button("Export", variant="primary", elem_id="export-start")
    result = gr.Markdown(elem_id="export-result")

    def sync(run):
        choices = checkpoint_choices(run)
        return run, gr.update(choices=choices, value=choices[0][1] if choices else None), default_out(run)

    run_dir_shared.change(sync, run_dir_shared, [run_dir, checkpoint, out])

    def on_refresh(run, current_out):
        choices = checkpoint_choices(run)
        return gr.update(choices=choices, value=choices[0][1] if choices else None), current_out or default_out(run)

    refresh.click(on_refresh, [run_dir, out], [checkpoint, out])
    run_dir.submit(on_refresh, [run_dir, out], [checkpoint, out])

    @guarded(1, error_index=0)
    def export(run, ckpt, out_dir, base_choice, gguf, replace, repo, is_private, progress=gr.Progress(track_tqdm=True)):
        return on_export(run, ckpt, out_dir, base_choice, gguf, replace, repo, is_private, progress)

    export_btn.click(export, [run_dir, checkpoint, out, base, types, overwrite, hub_repo, private], result)

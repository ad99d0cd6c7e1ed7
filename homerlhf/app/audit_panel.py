"""The monitor's audit verdict: what ``homerlhf audit RUN_DIR`` says of the attached run
(:func:`homerlhf.ppo.audit.audit_run`), as markdown under the figure: clean, or each flag raised with
the iterations it was up, the cause it points to and a sample that shows it. The timer reads it again
when ``metrics.jsonl`` changed, so a running run's verdict follows it; a run it cannot audit (no
iteration yet, no samples, no signals logged) says why in one line.

The signals explain a hacked run after the fact better than they warn early: the verdict says so.
"""

from __future__ import annotations

from pathlib import Path

from homerlhf.app import feedback_runs, runs
from homerlhf.errors import UserError

AFTER_THE_FACT = ("These signals explain a hacked run after the fact better than they warn early: read the samples "
                  "(*Sample history*). The same verdict on a terminal: `homerlhf audit RUN_DIR`.")
RESPONSE_CHARS = 200


def _ranges(iterations: list[int]) -> str:
    """[3, 4, 5, 8] -> '3-5, 8'."""
    parts: list[list[int]] = []
    for it in iterations:
        if parts and it == parts[-1][-1] + 1:
            parts[-1].append(it)
        else:
            parts.append([it])
    return ", ".join(f"{p[0]}-{p[-1]}" if len(p) > 1 else str(p[0]) for p in parts)


def _clip(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= RESPONSE_CHARS else text[:RESPONSE_CHARS] + "…"


def _code(text: str) -> str:
    """Text shown as is in markdown: an inline code span its backticks cannot end."""
    return "`` " + text.replace("`", "'") + " ``"


def verdict_markdown(run_dir: str) -> str:
    """The audit of ``run_dir`` as the monitor shows it ('' with no run attached)."""
    from homerlhf.ppo.audit import audit_run

    if not run_dir:
        return ""
    if feedback_runs.is_preference_run(run_dir, runs.run_status(run_dir).argv):
        return "**Audit:** for PPO, GRPO and RLOO runs: this is a DPO / KTO run, trained on pairs, not on samples."
    try:
        audit = audit_run(Path(run_dir))
    except UserError as exc:
        return f"**Audit:** not available yet: {exc}"
    if audit.ok:
        names = ", ".join(s.name for s in audit.signals)
        return (f"**Audit: clean**: no flag raised over {audit.iterations} iteration(s) (signals: {names}).\n\n"
                f"{AFTER_THE_FACT}")
    lines = [f"**Audit: {len(audit.flags)} flag(s) raised** over {audit.iterations} iteration(s): "
             + ", ".join(f.name for f in audit.flags)]
    for flag in audit.flags:
        lines.append(f"- **{flag.name}** at iteration(s) {_ranges(flag.iterations)}: `{flag.metric}` "
                     f"{flag.threshold}. Likely cause: {flag.cause}")
        for sample in flag.examples[:1]:
            score = sample.get("score")
            score = f"{score:.4g}" if isinstance(score, (int, float)) else "none"
            lines.append(f"  - iteration {sample.get('iteration')}, score {score}: {_code(_clip(sample.get('response', '')))}")
    return "\n".join(lines) + f"\n\n{AFTER_THE_FACT}"


def metrics_stamp(run_dir: str) -> list:
    """What says the run's metrics (or samples) changed since the verdict was drawn."""
    if not run_dir:
        return [""]
    stamp: list = [run_dir]
    for name in (runs.METRICS_FILE, runs.SAMPLES_FILE):
        try:
            stat = (Path(run_dir) / name).stat()
            stamp += [stat.st_size, stat.st_mtime_ns]
        except OSError:
            stamp += [0, 0]
    return stamp


def poll(run_dir: str, stamp) -> tuple:
    """The timer's update: (verdict, stamp); nothing redrawn while the run's logs are as they were."""
    import gradio as gr

    now = metrics_stamp(run_dir)
    if stamp and list(stamp) == now:
        return gr.update(), stamp
    return verdict_markdown(run_dir), now


def layout() -> tuple:
    """The verdict, under the figure: (its markdown, the stamp state)."""
    import gradio as gr

    with gr.Accordion("Audit (reward-hacking signals)", open=True, elem_id="train-audit-box"):
        verdict = gr.Markdown(elem_id="train-audit")
    return verdict, gr.State([])


def wire(parts: tuple, attached, timer) -> None:
    """The verdict follows the attached run (``attached``, a gr.State) at each ``timer`` tick and on attach."""
    verdict, stamp = parts
    timer.tick(poll, [attached, stamp], [verdict, stamp], show_progress="hidden")
    attached.change(poll, [attached, stamp], [verdict, stamp], show_progress="hidden")

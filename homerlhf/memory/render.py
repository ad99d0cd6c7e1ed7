"""A plan for people: per-phase tables (rich), and a stacked bar chart (matplotlib) for the CLI and app."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from homerlhf.errors import UserError
from homerlhf.memory.checkpointing import checkpointing_line
from homerlhf.memory.components import GIB
from homerlhf.memory.critic_compare import critic_table
from homerlhf.memory.planner import MARGIN, Plan
from homerlhf.memory.shapes import ModelShape, resolve_shape

KIND_ORDER = ("weights", "adapters", "optimizer", "gradients", "buffers", "kv_cache", "activations", "logits", "overhead")
KIND_COLORS = {
    "weights": "#4c72b0", "adapters": "#55a868", "optimizer": "#8172b2", "gradients": "#ccb974",
    "buffers": "#937860", "kv_cache": "#dd8452", "activations": "#c44e52", "logits": "#da8bc3", "overhead": "#8c8c8c",
}


def shape_for(cfg, model: Optional[str] = None) -> ModelShape:
    """The shape of ``model`` (default: the config's model), offline."""
    return resolve_shape(model or cfg.model.name_or_path, revision=None if model else cfg.model.revision)


def _gib(value: float) -> str:
    return f"{value:.2f}"


def print_plan(plan: Plan, console=None) -> None:
    """One table per phase, a summary, the verdict and (when it does not fit) the suggestion."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = console or Console(width=110)
    shape = plan.shape
    s = plan.settings
    console.print(
        f"Memory plan: {plan.model} ({plan.params['total'] / 1e9:.2f} B params, {shape['source']}) "
        f"on {plan.card}" + (f" ({plan.gpu_gib:g} GiB)" if plan.gpu_gib else "")
        + f", preset {plan.preset}",
        highlight=False,
    )
    console.print(
        f"scoring chunk {s['rollout.chunk_size']} x ({s['rollout.max_prompt_len']} + {s['rollout.max_new_tokens']}) tokens, "
        f"micro-batch {s['ppo.micro_batch_size']}, log-prob chunk {s['ppo.logprob_chunk_size']}, "
        f"checkpointing {'on' if s['training.gradient_checkpointing'] else 'off'}, "
        + (f"optimizers {s['actor.optimizer']} / {s['critic.optimizer']}" if s.get("algorithm", "ppo") == "ppo"
           else f"{s['algorithm']}: no critic, optimizer {s['actor.optimizer']}"),
        highlight=False,
    )
    console.print(generation_line(plan), highlight=False)
    console.print(precision_line(plan), highlight=False)
    if plan.checkpointing:
        console.print(checkpointing_line(plan.checkpointing), highlight=False)
    dist = plan.distributed
    if dist.get("gpus", 1) > 1:
        console.print(f"{dist['gpus']} GPUs, {'sharded base (FSDP)' if dist['fsdp'] else 'data parallel (DDP)'}: "
                      f"global batch {dist['global_batch']}, {dist['per_gpu_batch']} per GPU; every figure below is "
                      "one GPU's", highlight=False)
    for phase in plan.phases:
        table = Table(title=f"{phase.name}: peak at {phase.moment}", title_justify="left", show_footer=True)
        table.add_column("component", footer="total")
        table.add_column("GiB", justify="right", footer=_gib(phase.total_gib))
        table.add_column("dtype")
        table.add_column("note", footer=f"allocated (torch): {_gib(phase.allocated_gib)} GiB")
        for comp in phase.components:
            note = comp.note + ("" if comp.in_allocator else ("; " if comp.note else "") + "outside the torch allocator")
            table.add_row(escape(comp.name), _gib(comp.gib), escape(comp.dtype), escape(note))
        console.print(table)
    summary = Table(title="phases", title_justify="left")
    for col in ("phase", "peak moment", "allocated GiB", "total GiB"):
        summary.add_column(col, justify="left" if col in ("phase", "peak moment") else "right")
    for phase in plan.phases:
        mark = " <- peak" if phase.name == plan.peak.name else ""
        summary.add_row(phase.name + mark, phase.moment, _gib(phase.allocated_gib), _gib(phase.total_gib))
    console.print(summary)
    prefix = {"fits": "OK: ", "tight": "TIGHT: ", "over": "NO: ", None: ""}[plan.status]
    console.print(prefix + plan.verdict(), highlight=False)
    if plan.fits is False:
        console.print(suggestion_line(plan), highlight=False)
    _print_workers(plan, console)
    if plan.timing is not None:
        print_time(plan.timing, console)
    critic_table(plan.critic, console)  # critic.model: both placements of the critic
    for note in plan.notes:
        console.print(f"note: {note}", highlight=False)


def generation_line(plan: Plan) -> str:
    """The generation chunk in words: what the config asks, what the card affords, the KV cache's cost."""
    gen = plan.generation
    kv = f"KV cache {gen['kv_bytes_per_token'] / 1024:,.0f} KiB per token"
    largest = gen.get("largest_that_fits")
    affords = (f"the largest that leaves {MARGIN:.0%} of the card free (generation peak "
               f"{gen['largest_generation_gib']:.2f} GiB)") if largest is not None else ""
    if gen["setting"] == "auto":
        return f"generation chunk {gen['chunk']} (rollout.generation_chunk=auto: {affords or 'no GPU budget'}); {kv}"
    where = "rollout.generation_chunk" if gen["setting"] is not None else "rollout.chunk_size"
    hint = f"; the card affords {largest} ({affords}): --set rollout.generation_chunk=auto" \
        if largest is not None and largest > gen["chunk"] else ""
    return f"generation chunk {gen['chunk']} ({where}){hint}; {kv}"


def precision_line(plan: Plan) -> str:
    """Which dtype the base's weights, the activations and what trains are in (the components' own)."""
    dtypes = {c.name: c.dtype for phase in plan.phases for c in phase.components}
    frozen, act = dtypes.get("embeddings", "?"), dtypes.get("hidden states", "?")
    upcast = plan.settings.get("quant.upcast_non_quantized")
    why = ("quant.upcast_non_quantized=true: peft's fp32 upcast" if upcast and frozen == "fp32"
           else "the compute dtype end to end")
    return (f"precision: embeddings, LM head and norms {frozen}; hidden states and KV cache {act} ({why}); "
            "logits, LoRA, value head and gradients fp32; optimizer states as named")


def _print_workers(plan: Plan, console) -> None:
    """Host RAM of the local llama.cpp workers, against this machine's."""
    from rich.markup import escape
    from rich.table import Table

    if not plan.workers:
        return
    table = Table(title="llama.cpp workers: host RAM", title_justify="left", show_footer=True)
    table.add_column("worker", footer="total")
    table.add_column("component")
    table.add_column("GiB", justify="right", footer=_gib(plan.workers_host_gib))
    table.add_column("note")
    for role, comps in plan.workers.items():
        for comp in comps:
            table.add_row(role, escape(comp.name), _gib(comp.gib), escape(comp.note))
    console.print(table)
    import psutil

    ram = psutil.virtual_memory().total / GIB
    who = "the workers and the offloaded activations" if "activation offload" in plan.workers else "the workers"
    over = "; NOT enough for them" if plan.workers_host_gib > ram else ""
    console.print(f"{who} need {plan.workers_host_gib:.2f} GiB of host RAM; this machine has {ram:.1f} GiB{over}",
                  highlight=False)


def print_time(rec, console=None) -> None:
    """Seconds per iteration (a :class:`homerlhf.memory.placement.Recommendation`): per phase, the
    critical path, and the placements compared."""
    from rich.console import Console
    from rich.table import Table

    from homerlhf.memory.placement import summary_lines
    from homerlhf.memory.timing import human_seconds, phase_rows

    console = console or Console(width=110)
    it = rec.current.time
    table = Table(title=f"time per iteration: {it.placement.label()}", title_justify="left")
    for col in ("phase", "seconds", "runs on"):
        table.add_column(col, justify="right" if col == "seconds" else "left")
    for name, seconds, where in phase_rows(it):
        table.add_row(name, f"{seconds:.2f}", where)
    console.print(table)
    for line in summary_lines(rec):
        console.print(line, highlight=False)
    cands = Table(title="placements compared (fastest first)", title_justify="left")
    for col in ("ref", "reward", "rollout", "s / iteration", "GPU peak GiB", "fits"):
        cands.add_column(col, justify="right" if col in ("s / iteration", "GPU peak GiB") else "left")
    for c in rec.candidates:
        p = c.time.placement
        seconds = f"{c.time.total_s:,.1f}" + ("" if c.time.total_s < 90 else f" ({human_seconds(c.time.total_s)})")
        cands.add_row(p.ref, p.reward, p.engine, seconds,
                      "-" if c.peak_gib is None else f"{c.peak_gib:.2f}", "yes" if c.fits else "no")
    console.print(cands)


def suggestion_line(plan: Plan) -> str:
    """What to change when the plan is tight or over: the suggestion, or why there is none."""
    margin = f"{MARGIN:.0%} of the card free"
    if plan.suggestion is None:
        return f"no setting in the search fits with {margin}: use a smaller model or a larger card"
    sug = plan.suggestion
    args = " ".join(f"--set {a}" for a in sug.set_args)
    restores = "restores the margin" if plan.status == "tight" else "fits"
    return f"suggestion that {restores} (peak {sug.peak_gib:.2f} GiB, {sug.headroom_gib:.2f} GiB headroom): {args}"


def plan_figure(plan: Plan):
    """A matplotlib Figure: one stacked bar per phase (GiB by kind of component), the card as a line."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, 4.8), layout="constrained")
    ax = fig.add_subplot()
    names = [p.name for p in plan.phases]
    bottoms = [0.0] * len(names)
    # A plan under 1 GiB (a tiny model on a CPU) in MiB: in GiB its bars would all read 0.0.
    unit, scale = ("GiB", GIB) if plan.peak_gib >= 1 or plan.gpu_gib > 0 else ("MiB", GIB / 1024)
    for kind in KIND_ORDER:
        heights = [sum(c.bytes for c in p.components if c.kind == kind) / scale for p in plan.phases]
        if not any(heights):
            continue
        ax.bar(names, heights, bottom=bottoms, label=kind.replace("_", " "), color=KIND_COLORS[kind], width=0.6)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    for x, total in enumerate(bottoms):
        ax.text(x, total, f"{total:.1f}", ha="center", va="bottom", fontsize=9)
    if plan.gpu_gib > 0:
        ax.axhline(plan.gpu_gib, color="black", linestyle="--", linewidth=1)
        ax.text(len(names) - 0.5, plan.gpu_gib, f" {plan.card}: {plan.gpu_gib:g} GiB", va="bottom", ha="right", fontsize=9)
        ax.set_ylim(0, max(plan.gpu_gib, max(bottoms)) * 1.12)
    ax.set_ylabel(unit)
    ax.set_title(f"{plan.model} — preset {plan.preset}", fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    return fig


def save_plan_figure(plan: Plan, path: str | Path) -> Path:
    out = Path(path)
    if out.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise UserError(f"--plot {out}: use a .png, .svg or .pdf file name")
    if not out.parent.is_dir():
        raise UserError(f"--plot {out}: folder {out.parent} does not exist; create it or pick another path")
    try:
        plan_figure(plan).savefig(out, dpi=120)
    except OSError as exc:
        raise UserError(f"cannot write {out}: {exc.strerror}; pick a writable path") from None
    return out

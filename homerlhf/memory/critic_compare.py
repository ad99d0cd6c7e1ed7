"""Both placements of the critic side by side, for ``homerlhf plan`` with ``critic.model``: a LoRA on the
policy's base (``critic.model`` unset) and its own base, each planned as a run would be
(:func:`homerlhf.memory.placement.placed_plan`): GiB per phase, the verdict, seconds per iteration."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from homerlhf.memory.shapes import ModelShape


def critic_sides(cfg, shape: ModelShape, rates=None, gpu_gib: Optional[float] = None,
                 rewards: Optional[Sequence[str]] = None) -> list[dict[str, Any]]:
    """One row per placement of the critic (on the policy's base first); [] without ``critic.model``
    or without a critic (GRPO / RLOO)."""
    from homerlhf.memory.placement import placed_plan

    if not cfg.has_critic or not cfg.critic.model:
        return []
    on_base = cfg.model_copy(update={"critic": cfg.critic.model_copy(update={"model": None})})
    rows = []
    for label, side in (("on the policy's base (LoRA)", on_base), (f"its own: {cfg.critic.model}", cfg)):
        planned = placed_plan(side, shape, rates, gpu_gib, rewards)
        time = planned.timing.current.time if planned.timing is not None else None
        rows.append({"critic": label, "phases_gib": {p.name: round(p.total_gib, 4) for p in planned.phases},
                     "peak_gib": round(planned.peak_gib, 4), "status": planned.status,
                     "seconds_per_iteration": None if time is None else round(time.total_s, 3),
                     "update_s": None if time is None else round(time.update_s, 3)})
    return rows


def critic_table(rows: list[dict[str, Any]], console) -> None:
    """The rows of :func:`critic_sides` as a table."""
    from rich.markup import escape
    from rich.table import Table

    if not rows:
        return
    phases = list(rows[0]["phases_gib"])
    table = Table(title="the critic: on the policy's base vs its own model", title_justify="left")
    for col in ("critic", *(f"{p} GiB" for p in phases), "peak GiB", "verdict", "s / iteration", "update s"):
        table.add_column(col, justify="left" if col in ("critic", "verdict") else "right", overflow="fold")
    for row in rows:
        seconds = "-" if row["seconds_per_iteration"] is None else f"{row['seconds_per_iteration']:.1f}"
        update = "-" if row["update_s"] is None else f"{row['update_s']:.1f}"
        table.add_row(escape(row["critic"]), *(f"{row['phases_gib'][p]:.2f}" for p in phases),
                      f"{row['peak_gib']:.2f}", row["status"] or "-", seconds, update)
    console.print(table)

"""The plan each case of ``homerlhf check`` is compared with: the planner's
:class:`~homerlhf.memory.components.Assumptions` for what the compared iteration (a case's last) ran,
phase by phase, read from the case's optimizer steps (``trainer.updater.state.history``, in order):
:func:`iteration_assumptions` says what the trainer's code makes of them.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Optional

PHASES = ("generation", "scoring", "update")


def step_flags(rows: list[dict], skipped: Optional[list[bool]] = None) -> list[list[bool]]:
    """Per iteration, per optimizer step in order: taken (True) or skipped. From the trainer's steps in
    order (``skipped``, ``trainer.updater.state.history``'s flags) when given, else from the rows'
    counts (taken first: exact for one step an iteration, or none skipped)."""
    counts = [int(r.get("optimizer_steps", 0)) for r in rows]
    if skipped is not None and len(skipped) >= sum(counts):
        flags, start = [], len(skipped) - sum(counts)
        for n in counts:
            flags.append([not s for s in skipped[start:start + n]])
            start += n
        return flags
    return [[True] * (n - int(r.get("nonfinite_skipped_steps", 0))) + [False] * int(r.get("nonfinite_skipped_steps", 0))
            for n, r in zip(counts, rows)]


def compared_steps(result: dict, kind: str) -> tuple[list[list[bool]], bool]:
    """(the step flags of the iterations this process ran since its last workspace release, the last
    being the compared one; whether a checkpoint's optimizer states were loaded before them). The CLI
    case: the ``train --resume`` process ran the last iteration alone, after a resume; the resume case:
    the resumed trainer's iteration (``resumed_states``: the first trainer took a step)."""
    flags = step_flags(result["rows"], result.get("step_skipped"))
    if kind == "cli":
        return flags[-1:], any(taken for it in flags[:-1] for taken in it)
    return flags, bool(result.get("resumed_states"))


def iteration_assumptions(steps: list[list[bool]], decoder: str, resumed_states: bool = False) -> dict:
    """``{phase: Assumptions}`` for the last iteration of ``steps`` (this process's, since the last
    workspace release): ``resumed_states`` when a checkpoint's optimizer states were loaded before the
    first of them (a checkpoint written after a taken step). What the trainer's code makes of the steps
    (``homerlhf/ppo/update.py``, ``checkpoint.py``):

    - **Optimizer states** exist from the first optimizer step *taken* (AdamW and bitsandbytes make them
      lazily in ``step``; a step the fp16 scaler or the non-finite guard skips makes none), or from a
      resume (``load_optimizers`` hands the checkpoint's states to the new optimizer).
    - **Gradients held** through the next generation and scoring: after a taken step only (a skipped
      step zeroes them), and never right after a resume (new parameters).
    - **cuBLAS handles**: one per thread that multiplies; autograd's backward thread makes its own at
      the first backward. ``runs.release_memory`` frees every workspace between cases, so a case's
      first iteration plans one handle for generation and scoring.
    - **The update**: its optimizer states exist for every mini-batch after a taken step, so an
      iteration of several steps counts them there even in the first.
    - **The decoder** the case resolved (``runs.decoder_used``): ``hf`` or ``static``, not ``any``."""
    from homerlhf.memory.components import Assumptions

    *before, last = steps
    earlier = [taken for it in before for taken in it]
    states = resumed_states or any(earlier)
    rollout = Assumptions(after_first_step=states, held_gradients=bool(earlier) and earlier[-1],
                          cublas_handles=2 if earlier else 1, decoder=decoder)
    update = Assumptions(after_first_step=states or any(last[:-1]), cublas_handles=2, decoder=decoder)
    return {"generation": rollout, "scoring": rollout, "update": update}


def planned_decoder(decoder_used: Optional[str], setting: str, device: str) -> str:
    """``hf`` or ``static``: what sampled (``runs.decoder_used``'s words), else the setting resolved
    for the device (the CLI case's subprocess: a decline there is not seen)."""
    if decoder_used:
        return "hf" if decoder_used.startswith("hf generate") else "static"
    from homerlhf.models.static_decode import resolve_decoder

    return resolve_decoder(setting, device)


def described(assumptions, cfg) -> dict:
    """An Assumptions as the JSON says it: its fields, the held gradients resolved, the workspaces."""
    from homerlhf.memory.components import cublas_workspaces

    out = asdict(assumptions)
    if out["held_gradients"] is None:
        out["held_gradients"] = out["after_first_step"]
    out["cublas_workspaces"] = cublas_workspaces(cfg, assumptions) if cfg.card.device == "cuda" else 0
    return out


def case_plans(cfg, shape, cap: float, per_phase: dict) -> tuple[dict, dict]:
    """The plan to compare with, per phase from the plan of that phase's assumptions, and the
    steady-state plan (the planner's defaults: what a long run reaches) beside it. Returns
    (``{"status", "phases": {name: {allocated_gib, total_gib, moment}}, "steady_state": ...}``, the
    per-phase plans by name)."""
    from homerlhf.memory.planner import plan

    plans, chosen = {}, {}
    for name, assumed in per_phase.items():
        if assumed not in plans:
            plans[assumed] = plan(cfg, shape, cap, assumptions=assumed, with_suggestion=False)
        chosen[name] = plans[assumed].phase(name)
    steady = plan(cfg, shape, cap, with_suggestion=False)

    def phases(items) -> dict:
        return {p.name: {"allocated_gib": round(p.allocated_gib, 4), "total_gib": round(p.total_gib, 4),
                         "moment": p.moment} for p in items}

    entry = {"status": steady.status, "phases": phases(chosen.values()), "steady_state": phases(steady.phases)}
    return entry, chosen


def comparison(chosen: dict, measured_gib: dict) -> dict:
    """:func:`homerlhf.memory.planner.compare` over the per-phase plans."""
    from types import SimpleNamespace

    from homerlhf.memory.planner import compare

    return compare(SimpleNamespace(phases=list(chosen.values())), measured_gib)

"""The Plan tab's time section: seconds per phase, the critical path, the recommended placement as
overrides, and every placement compared, each with the phase that takes most of its time and where it runs
(so an hour-long placement says why: a model on llama.cpp on the CPU)."""

from __future__ import annotations

from typing import Optional


def time_markdown(plan, reward_model: Optional[str] = None) -> str:
    """The plan's time section: time per phase, the critical path, the recommendation as overrides, and
    the placements compared (from `homerlhf bench` figures, or the defaults, marked as such)."""
    from homerlhf.memory.placement import budget_words, summary_lines
    from homerlhf.memory.timing import human_seconds, phase_rows
    from homerlhf.models.reward_kinds import assumed_note

    rec = plan.timing
    if rec is None:
        return ""
    lines = [f"**Time per iteration** ({rec.current.time.placement.label()})", "",
             "| phase | time | runs on |", "|---|---:|---|"]
    lines += [f"| {name} | {human_seconds(seconds)} | {where} |" for name, seconds, where in phase_rows(rec.current.time)]
    lines += [""] + [f"{line}  " for line in summary_lines(rec, app=True)]
    note = assumed_note(reward_model) if rec.best.time.placement.reward == "adapter" else ""
    lines += [f"Note: {note}  "] if note else []
    fits = f"fits {budget_words(rec.budget_gib)}" if rec.budget_gib > 0 else "fits"
    lines += ["", f"| ref | reward | rollout | per iteration | most of it | GPU peak GiB | {fits} |",
              "|---|---|---|---:|---|---:|---|"]
    for c in rec.candidates:
        p = c.time.placement
        peak = "-" if c.peak_gib is None else f"{c.peak_gib:.2f}"
        lines.append(f"| {p.ref} | {p.reward} | {p.engine} | {human_seconds(c.time.total_s)} | {slowest_phase(c.time)} | "
                     f"{peak} | {'yes' if c.fits else 'no'} |")
    slow = [c for c in rec.candidates if c.time.total_s > 10 * rec.best.time.total_s]
    on_cpu = lambda c: "llamacpp" in (c.time.placement.ref, c.time.placement.reward, c.time.placement.engine)  # noqa: E731
    if slow and all(on_cpu(c) for c in slow):
        lines += ["", f"Placements {human_seconds(min(c.time.total_s for c in slow))} and slower put a model on "
                      "llama.cpp on the CPU (*most of it* says which phase): a CPU reads the model's weights for "
                      "every token far slower than the card, so they are listed to compare, not to pick."]
    lines += ["", "For this machine's own figures run `homerlhf bench` in a terminal (same preset and overrides). "
                  "Your overrides win over the recommendation, which is advice only."]
    return "\n".join(lines)


# Where each phase runs, by its placement's backend (llama.cpp workers and engine run on the CPU).
_RUNS_ON = {"llamacpp": "llama.cpp, CPU"}
_PHASE_BACKEND = {"generation": "engine", "reference": "ref", "reward": "reward"}


def slowest_phase(it) -> str:
    """The phase that takes the most of an iteration and where it runs: 'reward scoring (llama.cpp, CPU)'."""
    from homerlhf.memory.timing import PHASE_TITLES

    name = max(it.phases, key=it.phases.get)
    backend = getattr(it.placement, _PHASE_BACKEND.get(name, ""), None) if name in _PHASE_BACKEND else None
    return f"{PHASE_TITLES[name]} ({_RUNS_ON.get(backend, 'trainer')})"

"""Where the reference, the reward model and the rollout should run: every placement's predicted
iteration time (:mod:`homerlhf.memory.timing`) and GPU peak (:mod:`homerlhf.memory.planner`), and the
fastest that fits the card, with what it saves."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from homerlhf.config.schema import RunConfig
from homerlhf.memory.shapes import ModelShape
from homerlhf.memory.timing import IterationTime, Placement, Throughputs, default_throughputs, iteration_time, placement_of


@dataclass
class Candidate:
    time: IterationTime
    peak_gib: Optional[float]  # GPU peak under this placement (None: no GPU budget)
    fits: bool


@dataclass
class Recommendation:
    """Every placement tried, fastest first; the current one; the best that fits the GPU budget."""

    current: Candidate
    candidates: list[Candidate] = field(default_factory=list)

    @property
    def best(self) -> Candidate:
        fitting = [c for c in self.candidates if c.fits]
        return fitting[0] if fitting else self.current

    @property
    def saving_s(self) -> float:
        return self.current.time.total_s - self.best.time.total_s

    def per_role(self) -> dict[str, tuple[str, float]]:
        """``{role: (backend, seconds saved)}``: the best placement's choice for each role, and what
        it saves over the fastest fitting placement that keeps the role's current backend."""
        out = {}
        best, current = self.best.time.placement, self.current.time.placement
        for role in ("ref", "reward", "engine"):
            keep = [c for c in self.candidates if c.fits and getattr(c.time.placement, role) == getattr(current, role)]
            base = keep[0].time.total_s if keep else self.current.time.total_s
            out[role] = (getattr(best, role), max(0.0, base - self.best.time.total_s))
        return out

    def set_args(self) -> list[str]:
        """The ``--set`` overrides that move the run to the best placement (empty: it is already there)."""
        best, current = self.best.time.placement.overrides(), self.current.time.placement.overrides()
        return [f"{k}={v}" for k, v in best.items() if current[k] != v]

    def line(self) -> str:
        if not self.set_args():
            return (f"the current placement ({self.current.time.placement.label()}) is the fastest that fits: "
                    f"{self.current.time.total_s:.1f} s per iteration")
        ratio = self.current.time.total_s / self.best.time.total_s if self.best.time.total_s else math.inf
        return (f"recommended: {' '.join('--set ' + a for a in self.set_args())}: "
                f"{self.best.time.total_s:.1f} s per iteration instead of {self.current.time.total_s:.1f} s "
                f"({ratio:.1f}x faster, {self.saving_s:.1f} s saved)")

    def to_dict(self) -> dict[str, Any]:
        def cand(c: Candidate) -> dict[str, Any]:
            return {**c.time.to_dict(), "peak_gib": None if c.peak_gib is None else round(c.peak_gib, 4), "fits": c.fits}

        return {"current": cand(self.current), "candidates": [cand(c) for c in self.candidates],
                "best": self.best.time.placement.overrides(), "set_args": self.set_args(),
                "saving_s": round(self.saving_s, 4),
                "per_role": {k: {"backend": b, "saving_s": round(s, 4)} for k, (b, s) in self.per_role().items()},
                "line": self.line()}


def candidate_placements(cfg: RunConfig) -> list[Placement]:
    """Placements worth comparing: each role's backends that can serve it. A role served from a
    remote worker (``url``) or by reward functions keeps its backend."""
    refs = [cfg.ref.backend] if cfg.ref.url else ["llamacpp", "adapter_off"]
    fixed_reward = cfg.reward.url or cfg.reward.backend == "function" or cfg.reward.components
    rewards = [cfg.reward.backend] if fixed_reward else ["llamacpp", "adapter", "hf"]
    return [Placement(r, w, e) for r in refs for w in rewards for e in ("hf", "llamacpp")]


def extra_gpu_bytes(placement: Placement, cfg: RunConfig, shape: ModelShape) -> int:
    """GPU bytes a reward placement adds that the memory plan does not count: an in-process HF reward
    model of the policy's shape in the compute dtype (the plan counts a reward adapter itself)."""
    if cfg.card.device == "cpu":
        return 0
    if placement.reward == "hf":
        return (4 if cfg.quant.compute_dtype == "fp32" else 2) * shape.total_params
    return 0


def with_placement(cfg: RunConfig, placement: Placement) -> RunConfig:
    """``cfg`` with ``placement``'s backends (a copy for planning, not validated)."""
    return cfg.model_copy(update={
        "ref": cfg.ref.model_copy(update={"backend": placement.ref}),
        "reward": cfg.reward.model_copy(update={"backend": placement.reward}),
        "rollout": cfg.rollout.model_copy(update={"engine": placement.engine}),
    })


def recommend(cfg: RunConfig, shape: ModelShape, rates: Throughputs, *, cores: int, logical: Optional[int] = None,
              gpu_gib: Optional[float] = None) -> Recommendation:
    """Every candidate placement's predicted iteration time and GPU peak; fastest first. A placement
    fits when its peak (the memory plan's, + :func:`extra_gpu_bytes`) is within ``gpu_gib`` (default:
    the card's; no budget on a CPU card)."""
    from homerlhf.memory.components import GIB
    from homerlhf.memory.planner import plan

    budget = cfg.card.gpu_gib if gpu_gib is None else float(gpu_gib)

    def candidate(placement: Placement) -> Candidate:
        time = iteration_time(cfg, rates, placement, cores=cores, logical=logical)
        if budget <= 0:
            return Candidate(time, None, True)
        # The memory plan counts a reward adapter; an in-process hf reward adds extra_gpu_bytes on top.
        planned = with_placement(cfg, replace(placement, reward="llamacpp") if placement.reward == "hf" else placement)
        peak = plan(planned, shape, budget, with_suggestion=False).peak_gib + extra_gpu_bytes(placement, cfg, shape) / GIB
        return Candidate(time, peak, peak <= budget)

    here = placement_of(cfg)

    def order(c: Candidate) -> tuple:
        # Ties (to the microsecond) go to fewer changes from the config, then to less GPU memory.
        changed = sum(a != b for a, b in zip(c.time.placement.overrides().values(), here.overrides().values()))
        return round(c.time.total_s, 6), changed, c.peak_gib or 0.0

    cands = sorted((candidate(p) for p in candidate_placements(cfg)), key=order)
    current = next((c for c in cands if c.time.placement == here), None)
    return Recommendation(current or candidate(here), cands)


def attach_timing(plan_, cfg: RunConfig, shape: ModelShape, rates: Optional[Throughputs] = None,
                  gpu_gib: Optional[float] = None):
    """``plan_`` (a memory :class:`~homerlhf.memory.planner.Plan`) with its time section: the
    current placement's seconds per phase and the recommendation, from ``rates`` (default: the
    documented defaults) at this machine's core count. Returns ``plan_``."""
    import os

    from homerlhf.memory.threads import physical_cores

    cores, logical = physical_cores(), max(1, os.cpu_count() or 1)
    rates = rates or default_throughputs(shape, cfg, cores)
    plan_.timing = recommend(cfg, shape, rates, cores=cores, logical=logical, gpu_gib=gpu_gib)
    return plan_


def summary_lines(rec: Recommendation) -> list[str]:
    """The time section in words: critical path, total, recommendation, per-role savings."""
    it = rec.current.time
    bound = ("the trainer's own sequence (the workers keep up)" if it.critical == "trainer"
             else f"the workers: the trainer waits {it.wait_s:.1f} s for them after its last chunk")
    lines = [
        f"rollout + scoring stage {it.rollout_s:.1f} s (critical path: {bound}), update {it.update_s:.1f} s: "
        f"{it.total_s:.1f} s per iteration ({it.source})",
        rec.line(),
    ]
    if rec.set_args():
        lines.append("per role: " + "; ".join(
            f"{role} -> {backend}" + (f" (saves {saved:.1f} s)" if saved > 0 else "")
            for role, (backend, saved) in rec.per_role().items()))
    if rec.best.time.placement.reward == "adapter" and rec.set_args():
        lines.append("reward.backend=adapter needs a reward model trained as LoRA on the policy's own base")
    return lines

"""Where the reference, the reward model and the rollout should run: every placement's predicted
iteration time (:mod:`homerlhf.memory.timing`) and GPU peak (:mod:`homerlhf.memory.planner`), and the
fastest that fits the card, with what it saves."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Sequence

from homerlhf.config.schema import RunConfig
from homerlhf.errors import UserError
from homerlhf.memory.shapes import ModelShape
from homerlhf.memory.timing import (PHASE_TITLES, IterationTime, Placement, Throughputs, default_throughputs,
                                    human_seconds, iteration_time, placement_of)


@dataclass
class Candidate:
    time: IterationTime
    peak_gib: Optional[float]  # GPU peak under this placement (None: no GPU budget)
    fits: bool
    gen_chunk: int = 0  # the generation chunk timed and planned under this placement
    training: Any = None  # the training section, its auto checkpointing chosen under this placement


@dataclass
class Recommendation:
    """Every placement tried, fastest first; the current one; the best that fits the GPU budget."""

    current: Candidate
    candidates: list[Candidate] = field(default_factory=list)
    budget_gib: float = 0.0  # the GPU budget the candidates were fitted to (0: none)
    unavailable: dict[str, str] = field(default_factory=dict)  # rollout engine -> why it is no candidate

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

    def line(self, app: bool = False) -> str:
        """The recommendation in words; ``app``: as overrides to add (the app's), not ``--set`` flags."""
        if not self.current.fits and not any(c.fits for c in self.candidates):
            return (f"no placement fits {budget_words(self.budget_gib)}: the current one "
                    f"({self.current.time.placement.label()}) would take {human_seconds(self.current.time.total_s)} "
                    "per iteration once the memory plan fits (see its verdict)")
        if not self.set_args():
            return (f"the current placement ({self.current.time.placement.label()}) is the fastest that fits: "
                    f"{human_seconds(self.current.time.total_s)} per iteration")
        ratio = self.current.time.total_s / self.best.time.total_s if self.best.time.total_s else math.inf
        what = (f"add {' '.join(f'`{a}`' for a in self.set_args())} to the overrides" if app
                else ' '.join('--set ' + a for a in self.set_args()))
        return (f"recommended: {what}: {human_seconds(self.best.time.total_s)} per iteration instead of "
                f"{human_seconds(self.current.time.total_s)} ({ratio:.1f}x faster, {human_seconds(self.saving_s)} saved)")

    def to_dict(self) -> dict[str, Any]:
        def cand(c: Candidate) -> dict[str, Any]:
            return {**c.time.to_dict(), "peak_gib": None if c.peak_gib is None else round(c.peak_gib, 4), "fits": c.fits}

        return {"current": cand(self.current), "candidates": [cand(c) for c in self.candidates],
                "best": self.best.time.placement.overrides(), "set_args": self.set_args(),
                "saving_s": round(self.saving_s, 4),
                "per_role": {k: {"backend": b, "saving_s": round(s, 4)} for k, (b, s) in self.per_role().items()},
                "line": self.line(), "unavailable_engines": dict(self.unavailable)}


REWARD_BACKENDS = ("llamacpp", "adapter", "hf")  # where a reward model can run


def reward_candidates(cfg: RunConfig, possible: Optional[Sequence[str]] = None) -> list[str]:
    """Where the run's reward model could run: ``possible`` (what its files allow, from
    :func:`homerlhf.models.reward_kinds.possible_reward_backends`; default: all of
    :data:`REWARD_BACKENDS`), less ``adapter`` under ``rollout.async``. A backend the config names is
    kept, as a named engine is (a run's start checks the model's files against it). A reward served
    from a ``url``, by functions, or with components keeps its backend."""
    if cfg.reward.url or cfg.reward.backend == "function" or cfg.reward.components:
        return [cfg.reward.backend]
    found = [b for b in (possible if possible is not None else REWARD_BACKENDS) if b in REWARD_BACKENDS]
    if cfg.reward.backend in REWARD_BACKENDS and cfg.reward.backend not in found:
        found.append(cfg.reward.backend)
    return [b for b in found if not (b == "adapter" and cfg.rollout.async_)] or ["llamacpp"]


ENGINES = ("hf", "llamacpp")  # rollout engines
NO_LLAMA_CPP = "llama-cpp-python is not installed (`pip install llama-cpp-python` for the llamacpp engine)"


def unavailable_engines() -> dict[str, str]:
    """Rollout engines this machine cannot run, with why: ``llamacpp`` without the llama-cpp-python
    package (looked up, not imported)."""
    from importlib.util import find_spec

    return {} if find_spec("llama_cpp") is not None else {"llamacpp": NO_LLAMA_CPP}


def engine_candidates(cfg: RunConfig, unavailable: dict[str, str]) -> list[str]:
    """The rollout engines worth comparing: :data:`ENGINES` less the ``unavailable`` ones, and less
    ``hf`` under ``rollout.async`` (it cannot sample ahead); an engine the config names is kept."""
    engines = [e for e in ENGINES if e == cfg.rollout.engine
               or (e not in unavailable and not (e == "hf" and cfg.rollout.async_))]
    if not engines:
        raise UserError(f"rollout.async samples ahead with the llamacpp engine, and {unavailable['llamacpp']}; "
                        "set rollout.async=false")
    return engines


def candidate_placements(cfg: RunConfig, rewards: Optional[Sequence[str]] = None,
                         unavailable: Optional[dict[str, str]] = None) -> list[Placement]:
    """Placements worth comparing: each role's backends that can serve it (the reward's:
    :func:`reward_candidates`; the engine's: :func:`engine_candidates`). A reference served from a
    remote worker (``url``) keeps its backend."""
    refs = [cfg.ref.backend] if cfg.ref.url else ["llamacpp", "adapter_off"]
    engines = engine_candidates(cfg, unavailable_engines() if unavailable is None else unavailable)
    return [Placement(r, w, e) for r in refs for w in reward_candidates(cfg, rewards) for e in engines]


def is_auto(cfg: RunConfig) -> bool:
    """Whether a placement role (reference, reward, rollout engine) is ``auto``."""
    return "auto" in (cfg.ref.backend, cfg.reward.backend, cfg.rollout.engine)


def explicit(placement: Placement, cfg: RunConfig) -> bool:
    """Whether ``placement`` keeps every role the config names (``auto`` names none)."""
    return ((cfg.ref.backend == "auto" or placement.ref == cfg.ref.backend)
            and (cfg.reward.backend == "auto" or placement.reward == cfg.reward.backend)
            and (cfg.rollout.engine == "auto" or placement.engine == cfg.rollout.engine))


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


def _candidate(cfg: RunConfig, shape: ModelShape, rates: Throughputs, placement: Placement, budget: float,
               cores: int, logical: Optional[int]) -> Candidate:
    """One placement's iteration time and GPU peak, with an ``auto`` generation chunk resolved for it
    (the memory a placement takes is memory the chunk cannot have)."""
    from homerlhf.memory.checkpointing import resolve_checkpointing
    from homerlhf.memory.chunks import resolve_generation_chunk
    from homerlhf.memory.components import GIB
    from homerlhf.memory.planner import MARGIN, plan

    extra = extra_gpu_bytes(placement, cfg, shape) / GIB
    # The memory plan counts a reward adapter; an in-process hf reward adds extra_gpu_bytes on top.
    planned = with_placement(cfg, replace(placement, reward="llamacpp") if placement.reward == "hf" else placement)
    room = budget - extra if budget > 0 else budget
    planned = resolve_generation_chunk(resolve_checkpointing(planned, shape, room), shape, room)
    timed = with_placement(planned, placement)
    time = iteration_time(timed, rates, placement, cores=cores, logical=logical, shape=shape)
    chunk = planned.rollout.generation_chunk_size
    if budget <= 0:
        return Candidate(time, None, True, chunk, planned.training)
    peak = plan(planned, shape, budget, with_suggestion=False).peak_gib + extra
    return Candidate(time, peak, peak <= (1 - MARGIN) * budget, chunk, planned.training)  # fits with the margin


def recommend(cfg: RunConfig, shape: ModelShape, rates: Throughputs, *, cores: int, logical: Optional[int] = None,
              gpu_gib: Optional[float] = None, rewards: Optional[Sequence[str]] = None,
              unavailable: Optional[dict[str, str]] = None) -> Recommendation:
    """Every candidate placement's predicted iteration time and GPU peak; fastest first. A placement
    fits when its peak (the memory plan's, + :func:`extra_gpu_bytes`) leaves the plan's margin of
    ``gpu_gib`` free (default: the card's; no budget on a CPU card). ``rewards``: the backends the
    reward model can run on; ``unavailable``: rollout engines that cannot run, with why (default:
    :func:`unavailable_engines`).

    The current placement is the config's; where a role is ``auto``, the fastest candidate that fits
    and keeps the config's other roles (:func:`choose`)."""
    budget = cfg.card.gpu_gib if gpu_gib is None else float(gpu_gib)

    def order(c: Candidate) -> tuple:
        # Ties (to the microsecond) go to fewer changes from the config, then to less GPU memory.
        named = placement_of(cfg).overrides()
        changed = sum(a != b for a, b in zip(c.time.placement.overrides().values(), named.values()))
        return round(c.time.total_s, 6), changed, c.peak_gib or 0.0

    unavailable = unavailable_engines() if unavailable is None else dict(unavailable)
    cands = sorted((_candidate(cfg, shape, rates, p, budget, cores, logical)
                    for p in candidate_placements(cfg, rewards, unavailable)), key=order)
    if is_auto(cfg):
        return Recommendation(choose(cands, cfg), cands, budget, unavailable)
    here = placement_of(cfg)
    current = next((c for c in cands if c.time.placement == here), None)
    return Recommendation(current or _candidate(cfg, shape, rates, here, budget, cores, logical), cands, budget,
                          unavailable)


def choose(cands: Sequence[Candidate], cfg: RunConfig) -> Candidate:
    """What ``auto`` picks among ``cands`` (fastest first): the fastest that fits the card and keeps
    every role the config names; when none fits, the one with the smallest GPU peak."""
    kept = [c for c in cands if explicit(c.time.placement, cfg)]
    if not kept:
        named = [f"{key}={value}" for key, value in (("ref.backend", cfg.ref.backend),
                                                     ("reward.backend", cfg.reward.backend),
                                                     ("rollout.engine", cfg.rollout.engine)) if value != "auto"]
        raise UserError(f"no placement keeps {' and '.join(named)}; set "
                        f"{' or '.join(n.split('=')[0] for n in named)} to auto")
    fitting = [c for c in kept if c.fits]
    return fitting[0] if fitting else min(kept, key=lambda c: c.peak_gib or 0.0)


def resolve_placement(cfg: RunConfig, rec: Recommendation) -> RunConfig:
    """``cfg`` with its ``auto`` roles set to the chosen placement's (``rec.current``), and an ``auto``
    generation chunk and ``auto`` checkpointing to those planned under it."""
    chosen = rec.current
    update, rollout = {}, {}
    if cfg.ref.backend == "auto":
        update["ref"] = cfg.ref.model_copy(update={"backend": chosen.time.placement.ref})
    if cfg.reward.backend == "auto":
        update["reward"] = cfg.reward.model_copy(update={"backend": chosen.time.placement.reward})
    if cfg.rollout.engine == "auto":
        rollout["engine"] = chosen.time.placement.engine
    if cfg.rollout.generation_chunk == "auto":
        rollout["generation_chunk"] = chosen.gen_chunk
    if cfg.training.has_auto and chosen.training is not None:
        update["training"] = chosen.training
    if rollout:
        update["rollout"] = cfg.rollout.model_copy(update=rollout)
    return cfg.model_copy(update=update)


def choice_lines(rec: Recommendation, cfg: RunConfig) -> list[str]:
    """What ``auto`` chose, in words: the placement and its seconds per iteration, the alternatives
    that fit and those that do not, and the generation chunk."""
    chosen = rec.current
    what = "placement auto" if is_auto(cfg) else "placement as configured"
    lines = [f"{what}: {chosen.time.placement.label()}: {human_seconds(chosen.time.total_s)} per iteration"
             + (f", generation chunk {chosen.gen_chunk}" if cfg.rollout.generation_chunk == "auto" else "")
             + f" ({chosen.time.source})"]
    others = [c for c in rec.candidates if c is not chosen and explicit(c.time.placement, cfg)]
    fit = [f"{c.time.placement.label()} {human_seconds(c.time.total_s)}" for c in others if c.fits]
    over = [f"{c.time.placement.label()} {human_seconds(c.time.total_s)} (peak {c.peak_gib:.2f} GiB)"
            for c in others if not c.fits]
    if fit:
        lines.append("  alternatives that fit: " + "; ".join(fit))
    if over:
        lines.append(f"  over {budget_words(rec.budget_gib)}: " + "; ".join(over))
    return lines + engine_lines(rec, cfg)


def phase_words(it: IterationTime) -> str:
    """Seconds per phase in words, overlapped ones marked: what an engine's line shows."""
    return ", ".join(f"{PHASE_TITLES[name]} {human_seconds(seconds)}" + ("" if it.where[name] == "trainer"
                                                                          else " (overlapped)")
                     for name, seconds in it.phases.items())


def engine_lines(rec: Recommendation, cfg: RunConfig) -> list[str]:
    """``rollout.engine: auto``'s choice and its alternative (the other engine with the same
    reference and reward), each with its seconds per phase, or why there is no alternative."""
    if cfg.rollout.engine != "auto":
        return []
    chosen = rec.current.time
    other = next(e for e in ENGINES if e != chosen.placement.engine)
    alt = next((c for c in rec.candidates if c.time.placement == replace(chosen.placement, engine=other)), None)
    lines = [f"  rollout engine auto -> {chosen.placement.engine}: {human_seconds(chosen.total_s)} per iteration "
             f"({phase_words(chosen)})"]
    if other in rec.unavailable:
        return lines + [f"  {other}: not a candidate: {rec.unavailable[other]}"]
    if alt is None:
        return lines + [f"  {other}: not a candidate: rollout.async samples ahead with the llamacpp engine only"]
    fit = "" if alt.fits else f", over {budget_words(rec.budget_gib)}"
    return lines + [f"  the alternative, {other}: {human_seconds(alt.time.total_s)} per iteration{fit} "
                    f"({phase_words(alt.time)})"]


def budget_words(gpu_gib: float) -> str:
    """The budget a placement must fit, in words: the card less the margin a fit leaves free."""
    from homerlhf.memory.planner import MARGIN

    return f"the {1 - MARGIN:.0%} budget ({(1 - MARGIN) * gpu_gib:.1f} of {gpu_gib:g} GiB)"


def _cores() -> tuple[int, int]:
    import os

    from homerlhf.memory.threads import physical_cores

    return physical_cores(), max(1, os.cpu_count() or 1)


def attach_timing(plan_, cfg: RunConfig, shape: ModelShape, rates: Optional[Throughputs] = None,
                  gpu_gib: Optional[float] = None, rewards: Optional[Sequence[str]] = None):
    """``plan_`` (a memory :class:`~homerlhf.memory.planner.Plan`) with its time section: the
    current placement's seconds per phase and the recommendation, from ``rates`` (default: the
    documented defaults) at this machine's core count. Returns ``plan_``."""
    cores, logical = _cores()
    rates = rates or default_throughputs(shape, cfg, cores)
    plan_.timing = recommend(cfg, shape, rates, cores=cores, logical=logical, gpu_gib=gpu_gib, rewards=rewards)
    return plan_


def placed_plan(cfg: RunConfig, shape: ModelShape, rates: Optional[Throughputs] = None,
                gpu_gib: Optional[float] = None, rewards: Optional[Sequence[str]] = None):
    """The plan ``homerlhf train`` would run, with its time section: ``auto`` roles and generation chunk
    resolved as a run's start resolves them (:func:`choose` by ``rates``, default: the documented
    defaults); a config without ``auto`` is planned as it is."""
    from homerlhf.memory.planner import plan

    cores, logical = _cores()
    rates = rates or default_throughputs(shape, cfg, cores)
    rec = recommend(cfg, shape, rates, cores=cores, logical=logical, gpu_gib=gpu_gib, rewards=rewards)
    auto = is_auto(cfg)
    result = plan(resolve_placement(cfg, rec) if auto else cfg, shape, gpu_gib)
    result.timing = rec
    result.generation["setting"] = cfg.rollout.generation_chunk  # "auto", as the config says
    result.checkpointing.update(every_n_setting=cfg.training.checkpoint_every_n_layers,
                                offload_setting=cfg.training.activation_offload)  # "auto" too
    if auto:
        result.notes[:0] = choice_lines(rec, cfg)
    return result


def summary_lines(rec: Recommendation, app: bool = False) -> list[str]:
    """The time section in words: critical path, total, recommendation, per-role savings (``app``: the
    recommendation as overrides, :meth:`Recommendation.line`)."""
    it = rec.current.time
    bound = ("the trainer's own sequence (the workers keep up)" if it.critical == "trainer"
             else f"the workers: the trainer waits {human_seconds(it.wait_s)} for them after its last chunk")
    lines = [
        f"rollout + scoring stage {human_seconds(it.rollout_s)} (critical path: {bound}), update "
        f"{human_seconds(it.update_s)}: {human_seconds(it.total_s)} per iteration ({it.source})",
        rec.line(app),
    ]
    if rec.set_args():
        lines.append("per role: " + "; ".join(
            f"{role} -> {backend}" + (f" (saves {human_seconds(saved)})" if saved > 0 else "")
            for role, (backend, saved) in rec.per_role().items()))
    return lines

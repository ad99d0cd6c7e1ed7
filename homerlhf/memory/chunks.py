"""The generation chunk: how many prompts a rollout samples at once, sized by the memory plan.

Generation holds the KV cache of ``chunk x (prompt + new)`` tokens and, at the prefill, one layer's
activations over ``chunk x prompt`` tokens; scoring and the update have their own sizes
(``rollout.chunk_size``, ``ppo.micro_batch_size``). On a GPU a decode step of an NF4 + LoRA model
costs about the same time whatever the chunk (it is bound by kernel launches, ``docs/time.md``), so
the largest chunk the card affords is the fastest. ``rollout.generation_chunk: auto`` asks for it:
:func:`planned_generation_chunk` is the largest chunk (a multiple of 8 when one fits, at most the
batch one GPU samples) whose generation phase leaves :data:`~homerlhf.memory.plans.MARGIN` of the
card free, and raises the run's peak no higher than the other phases already put it.
"""

from __future__ import annotations

from typing import Any, Optional

from homerlhf.config.schema import RunConfig
from homerlhf.memory.components import GIB, Assumptions, dtype_bytes, kv_bytes_per_token
from homerlhf.memory.plans import MARGIN, build_plan, memory_view, persistent_of, phase_plan
from homerlhf.memory.shapes import ModelShape

MULTIPLE = 8  # preferred granularity of a planned chunk


def _with_chunk(cfg: RunConfig, chunk: Optional[int | str]) -> RunConfig:
    return cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"generation_chunk": chunk})})


def batch_per_gpu(cfg: RunConfig) -> int:
    """Prompts one process samples per iteration: the batch split over ``distributed.gpus``."""
    return max(1, cfg.rollout.batch_size // cfg.distributed.gpus)


def _limit_bytes(cfg: RunConfig, shape: ModelShape, gpu_gib: float, assumptions: Assumptions) -> float:
    """The most the generation phase may hold: the card less the margin, or the other phases' peak
    when that is higher already (a larger chunk then costs nothing the run does not need anyway)."""
    others = build_plan(_with_chunk(cfg, 1), shape, gpu_gib, assumptions=assumptions)
    other_peak = max(p.total_bytes for p in others.phases if p.name != "generation")
    return max((1 - MARGIN) * gpu_gib * GIB, other_peak)


def planned_generation_chunk(cfg: RunConfig, shape: ModelShape, gpu_gib: Optional[float] = None, *,
                             assumptions: Assumptions = Assumptions()) -> int:
    """The largest generation chunk for ``cfg`` on a ``gpu_gib`` card (default: the config's card).

    Capped at the batch one GPU samples; a multiple of :data:`MULTIPLE` when one fits (else the
    largest below it that does, at least 1). Without a GPU budget (a CPU card) it is the configured
    chunk: ``rollout.generation_chunk`` when a number, else ``rollout.chunk_size``, capped alike.
    """
    budget = cfg.card.gpu_gib if gpu_gib is None else float(gpu_gib)
    cap = batch_per_gpu(cfg)
    if budget <= 0:
        chosen = cfg.rollout.generation_chunk
        return min(cap, chosen if isinstance(chosen, int) else cfg.rollout.chunk_size)
    limit = _limit_bytes(cfg, shape, budget, assumptions)
    probe = memory_view(_with_chunk(cfg, 1))
    persistent = persistent_of(probe, shape, assumptions)

    def fits(chunk: int) -> bool:
        return phase_plan(probe, shape, assumptions, "generation", persistent, chunk=chunk).total_bytes <= limit

    multiples = list(range(cap - cap % MULTIPLE, 0, -MULTIPLE))  # largest first
    if multiples and fits(multiples[-1]):
        candidates = ([cap] if cap % MULTIPLE else []) + multiples  # the whole batch at once beats a multiple
    else:
        candidates = list(range(min(cap, MULTIPLE - 1), 0, -1))
    # Memory grows with the chunk: the first (largest) candidate that fits, by bisection.
    lo, hi = 0, len(candidates) - 1
    if not fits(candidates[hi]):
        return 1
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(candidates[mid]):
            hi = mid
        else:
            lo = mid + 1
    return candidates[lo]


def resolve_generation_chunk(cfg: RunConfig, shape: ModelShape, gpu_gib: Optional[float] = None, *,
                             assumptions: Assumptions = Assumptions()) -> RunConfig:
    """``cfg`` with ``rollout.generation_chunk: auto`` replaced by :func:`planned_generation_chunk`
    (a config with a number or nothing there is returned as it is)."""
    if cfg.rollout.generation_chunk != "auto":
        return cfg
    return _with_chunk(cfg, planned_generation_chunk(cfg, shape, gpu_gib, assumptions=assumptions))


def generation_chunk_info(cfg: RunConfig, shape: ModelShape, gpu_gib: Optional[float] = None, *,
                          assumptions: Assumptions = Assumptions()) -> dict[str, Any]:
    """What a plan shows of the generation chunk: the setting, the chunk used, the KV cache per token
    and, with a GPU budget, the largest chunk that fits (:func:`planned_generation_chunk`) and the
    generation phase's GiB at it."""
    _, a, _ = dtype_bytes(cfg, assumptions)
    resolved = resolve_generation_chunk(cfg, shape, gpu_gib, assumptions=assumptions)
    info: dict[str, Any] = {"setting": cfg.rollout.generation_chunk, "chunk": resolved.rollout.generation_chunk_size,
                            "kv_bytes_per_token": kv_bytes_per_token(shape, a)}
    budget = cfg.card.gpu_gib if gpu_gib is None else float(gpu_gib)
    if budget > 0:
        largest = planned_generation_chunk(cfg, shape, budget, assumptions=assumptions)
        probe = memory_view(_with_chunk(cfg, largest))
        gen = phase_plan(probe, shape, assumptions, "generation", persistent_of(probe, shape, assumptions))
        info.update(largest_that_fits=largest, largest_generation_gib=round(gen.total_gib, 4))
    return info

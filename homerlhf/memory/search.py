"""Suggestions: the cheapest overrides that make a plan fit its card.

The search runs over micro-batch (divisors of the mini-batch), rollout chunk (halvings), sequence
lengths, gradient checkpointing and paged 8-bit AdamW, and plans each candidate (an ``auto``
generation chunk resolved for each, and ``auto`` checkpointing before it).
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Iterable, Optional

from homerlhf.config.schema import RunConfig
from homerlhf.memory.checkpointing import resolve_checkpointing
from homerlhf.memory.chunks import resolve_generation_chunk
from homerlhf.memory.components import Assumptions
from homerlhf.memory.plans import Plan, Suggestion, build_plan
from homerlhf.memory.shapes import ModelShape


def apply_overrides(cfg: RunConfig, overrides: dict[str, Any]) -> RunConfig:
    """A new validated config with dotted-key overrides (the config itself is never mutated)."""
    from homerlhf.config.loader import deep_merge, validate

    nested: dict[str, Any] = {}
    for key, value in overrides.items():
        node = nested
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return validate(deep_merge(cfg.model_dump(mode="python"), nested))


def _halvings(value: int) -> list[int]:
    out = [value]
    while out[-1] > 1:
        out.append(max(1, out[-1] // 2))
    return out


def _round_len(value: float) -> int:
    return max(16, int(value) // 16 * 16)


LENGTH_SCALES = (1.0, 0.75, 0.5, 0.375, 0.25)
EIGHT_BIT = "paged_adamw_8bit"


def candidate_overrides(cfg: RunConfig) -> Iterable[tuple[tuple[float, float], dict[str, Any]]]:
    """(cost, overrides) over micro-batch, rollout chunk, lengths, checkpointing and optimizer.

    Cost is (share of length cut, slowdown proxy): shorter sequences change the task, so they come
    last; among the rest, checkpointing costs ~30% speed, each halving of micro-batch or chunk ~15%.
    """
    mini = cfg.ppo.mini_batch_size
    micros = [m for m in range(cfg.ppo.micro_batch_size, 0, -1) if mini % m == 0]
    chunks = _halvings(cfg.rollout.chunk_size)
    ckpts = sorted({cfg.training.gradient_checkpointing, True})
    optims = [None] + ([EIGHT_BIT] if (cfg.actor.optimizer, cfg.critic.optimizer) != (EIGHT_BIT, EIGHT_BIT) else [])
    for micro, chunk, scale, ckpt, optim in itertools.product(micros, chunks, LENGTH_SCALES, ckpts, optims):
        over: dict[str, Any] = {}
        if micro != cfg.ppo.micro_batch_size:
            over["ppo.micro_batch_size"] = micro
        if chunk != cfg.rollout.chunk_size:
            over["rollout.chunk_size"] = chunk
            if isinstance(cfg.rollout.generation_chunk, int):  # an explicit generation chunk halves alike
                over["rollout.generation_chunk"] = max(1, cfg.rollout.generation_chunk * chunk // cfg.rollout.chunk_size)
        if scale != 1.0:
            over["rollout.max_prompt_len"] = _round_len(cfg.rollout.max_prompt_len * scale)
            over["rollout.max_new_tokens"] = _round_len(cfg.rollout.max_new_tokens * scale)
        if ckpt != cfg.training.gradient_checkpointing:
            over["training.gradient_checkpointing"] = ckpt
        if optim:
            over["actor.optimizer"] = optim
            over["critic.optimizer"] = optim
        slowdown = (
            0.3 * (ckpt and not cfg.training.gradient_checkpointing)
            + 0.05 * bool(optim)
            + 0.15 * math.log2(cfg.ppo.micro_batch_size / micro)
            + 0.15 * math.log2(cfg.rollout.chunk_size / chunk)
        )
        yield (1.0 - scale, slowdown), over


def suggest(
    cfg: RunConfig,
    shape: ModelShape,
    gpu_gib: Optional[float] = None,
    *,
    assumptions: Assumptions = Assumptions(),
) -> Optional[Suggestion]:
    """The cheapest overrides (see :func:`candidate_overrides`) whose plan fits; None if none does."""
    budget = cfg.card.gpu_gib if gpu_gib is None else float(gpu_gib)
    if budget <= 0:
        return None
    best: Optional[tuple[tuple[float, float], dict[str, Any], Plan]] = None
    for cost, over in candidate_overrides(cfg):
        if best is not None and cost >= best[0]:
            continue
        chosen = resolve_checkpointing(apply_overrides(cfg, over), shape, budget, assumptions=assumptions)
        candidate = resolve_generation_chunk(chosen, shape, budget, assumptions=assumptions)
        trial = build_plan(candidate, shape, budget, assumptions=assumptions)
        if trial.fits:
            best = (cost, over, trial)
    if best is None:
        return None
    _, over, trial = best
    return Suggestion(overrides=over, peak_gib=trial.peak_gib, headroom_gib=trial.headroom_gib)


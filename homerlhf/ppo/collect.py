"""Stages 1 and 2 of a PPO iteration: rollout and scoring, overlapped.

Prompts are generated ``rollout.generation_chunk`` (default ``rollout.chunk_size``) at a time and
scored on the GPU ``rollout.chunk_size`` at a time; chunk k's reference log-probs and scores
are submitted to their backends (CPU workers) before chunk k's old log-probs and values are
computed and chunk k+1 is generated, so CPU scoring runs while the GPU works.

An out-of-memory error halves the rollout chunk (down to 1) for the rest of the run
(:class:`RolloutState`): in generation the chunk is generated again in halves, in scoring the
generated chunk is scored in halves. With per-sample ``seeds`` the samples are the same whatever
the chunk size (:mod:`homerlhf.models.sampling`), so a redo changes no sample.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor

from homerlhf.config.schema import RunConfig
from homerlhf.ppo.backends import ReferenceBackend, RewardBackend
from homerlhf.ppo.devices import to_trainer, worker_lists
from homerlhf.ppo.engines import HFEngine, RolloutEngine
from homerlhf.ppo.experience import Experience
from homerlhf.ppo.importance import truncated_importance_weights
from homerlhf.ppo.rollout import RolloutBatch, apply_truncation_penalty


@dataclass
class StageTimes:
    """Wall seconds of each stage of one iteration (the ``time_*_s`` metrics)."""

    generation: float = 0.0
    scoring: float = 0.0
    reference_reward_wait: float = 0.0
    advantages: float = 0.0
    update: float = 0.0


@dataclass
class RolloutState:
    """What survives between chunks and iterations: the rollout chunks in use and the OOM redos.

    ``chunk_size`` is the scoring chunk; ``generation_chunk`` the prompts generated at once when set
    apart from it (``rollout.generation_chunk``), each halved by an OOM in its own phase. None: the one
    ``chunk_size`` for both, which an OOM in either halves."""

    chunk_size: int
    oom_retries_generation: int = 0
    oom_retries_scoring: int = 0
    generation_chunk: Optional[int] = None

    @property
    def generating(self) -> int:
        return self.generation_chunk or self.chunk_size


def rollout_state(cfg: RunConfig, shape=None) -> RolloutState:
    """A fresh state at the configured chunks; an ``auto`` generation chunk (not resolved when the run
    started) is planned for ``shape`` (the policy's) on the config's card, or is ``chunk_size`` without one."""
    gen = cfg.rollout.generation_chunk
    if gen == "auto":
        from homerlhf.memory.chunks import planned_generation_chunk

        gen = planned_generation_chunk(cfg, shape) if shape is not None else None
    gen = gen or cfg.rollout.chunk_size
    return RolloutState(cfg.rollout.chunk_size, generation_chunk=None if gen == cfg.rollout.chunk_size else gen)


def phase(meter, name: str):
    """``meter.phase(name)`` (peak memory of a phase), or nothing without a meter."""
    return meter.phase(name) if meter is not None else contextlib.nullcontext()


@torch.no_grad()
def score_with_policy(policy, batch: RolloutBatch) -> tuple[Tensor, Tensor, Tensor]:
    """Old log-probs, entropy and values of a rollout batch, each (B, T), without graphs."""
    policy.checkpoint_activations(False)
    input_ids, attention_mask = batch.sequences()
    logprobs, entropy, values = policy.actor_logprobs_and_values(input_ids, attention_mask, batch.response_ids.shape[1])
    return logprobs.detach(), entropy.detach(), values.detach()


def score_in_chunks(policy, batch: RolloutBatch, state: RolloutState) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`score_with_policy` over ``batch`` in pieces of ``state.chunk_size`` rows, halving it on OOM."""
    from homerlhf.memory.oom import halved_after_oom

    pieces, start = [], 0
    while start < len(batch):
        end = min(len(batch), start + state.chunk_size)
        try:
            pieces.append(score_with_policy(policy, batch.rows(start, end)))
        except BaseException as exc:  # noqa: BLE001 - halved_after_oom re-raises all but an OOM
            state.chunk_size = halved_after_oom(exc, min(state.chunk_size, end - start), "scoring")
            state.oom_retries_scoring += 1
            continue
        start = end
    logprobs, entropy, values = (torch.cat(parts) for parts in zip(*pieces))
    return logprobs, entropy, values


def generate_chunk(engine: RolloutEngine, prompts, seeds, cfg: RunConfig, state: RolloutState) -> RolloutBatch:
    """The rollout of the next ``state.generating`` of ``prompts`` by ``engine`` (fewer after an OOM:
    it halves)."""
    from homerlhf.memory.oom import halved_after_oom

    while True:
        n = min(len(prompts), state.generating)
        try:
            return engine.generate(prompts[:n], cfg.rollout, seeds=None if seeds is None else seeds[:n])
        except BaseException as exc:  # noqa: BLE001 - halved_after_oom re-raises all but an OOM
            halved = halved_after_oom(exc, n, "generation")
            if state.generation_chunk is None:
                state.chunk_size = halved
            else:
                state.generation_chunk = halved
            state.oom_retries_generation += 1


def collect_experience(
    policy,
    prompts: Sequence[Sequence[int]],
    cfg: RunConfig,
    reference: ReferenceBackend,
    reward: RewardBackend,
    *,
    engine: Optional[RolloutEngine] = None,
    rows: Optional[Sequence[dict]] = None,
    meter=None,
    times: Optional[StageTimes] = None,
    seeds: Optional[Sequence[int]] = None,
    state: Optional[RolloutState] = None,
) -> tuple[Experience, Tensor]:
    """Generate and score one iteration's batch, chunk by chunk, overlapping CPU scoring.

    ``engine``: what samples (default: the actor's own ``generate``). ``seeds``: one per prompt
    (see :func:`homerlhf.ppo.rollout.generate_rollout`). ``state``: the chunk size in use and the
    OOM redos (kept by the trainer across iterations; default: a fresh one at
    ``rollout.chunk_size``). ``rows``: the dataset row of each prompt (indexed like ``prompts``),
    for reward functions. Returns the experience (scores are the raw backend scores with the
    truncation penalty applied; behaviour log-probs and importance weights set; rewards and
    advantages not yet computed) and the rollout entropy (B, T).
    """
    times = times if times is not None else StageTimes()
    engine = engine if engine is not None else HFEngine(policy)
    state = state if state is not None else rollout_state(cfg)
    pending, start = [], 0
    while start < len(prompts):
        t0 = time.perf_counter()
        with phase(meter, "generation"):
            batch = generate_chunk(engine, prompts[start:], None if seeds is None else seeds[start:], cfg, state)
            batch = to_trainer(batch, policy.device)  # an engine of another device's rollout
        chunk_rows = rows[start : start + len(batch)] if rows is not None else None
        start += len(batch)
        t1 = time.perf_counter()
        times.generation += t1 - t0
        prompt_lists, response_lists = worker_lists(batch)
        # Submitted before this chunk's own scoring and the next chunk's generation: they overlap.
        with phase(meter, "scoring"):
            ref_future = reference.submit_logprobs(prompt_lists, response_lists)
            score_future = reward.submit_score(prompt_lists, response_lists, chunk_rows)
            logprobs, entropy, values = score_in_chunks(policy, batch, state)
        times.scoring += time.perf_counter() - t1
        pending.append((batch, logprobs, entropy, values, ref_future, score_future))

    t0 = time.perf_counter()
    out = _assemble(pending, cfg, engine, policy.tokenizer.pad_token_id)
    times.reference_reward_wait += time.perf_counter() - t0
    return out


def build_experience(batch: RolloutBatch, logprobs: Tensor, values: Tensor, ref_logprobs: Tensor, raw_scores: Tensor,
                     cfg: RunConfig, shares_trainer_weights: bool) -> Experience:
    """One batch's experience from its rollout, the trainer's old log-probs and values (B, T), the
    reference log-probs (B, T) and the raw scores (B,): masks applied, truncation penalty, behaviour
    log-probs and importance weights set. Everything is placed on the old log-probs' device."""
    device = logprobs.device
    batch, ref_logprobs, raw_scores = (to_trainer(x, device) for x in (batch, ref_logprobs, raw_scores))
    mask = batch.response_mask
    # The trainer's own module sampled: its old log-probs are the behaviour policy's, exactly.
    behaviour = logprobs if shares_trainer_weights else batch.behaviour_logprobs
    return Experience(
        prompt_ids=batch.prompt_ids, prompt_mask=batch.prompt_mask,
        response_ids=batch.response_ids, response_mask=mask,
        old_logprobs=logprobs * mask, ref_logprobs=ref_logprobs * mask, values=to_trainer(values, device) * mask,
        scores=apply_truncation_penalty(raw_scores, batch, cfg.rollout), raw_scores=raw_scores,
        truncated=batch.truncated, behaviour_logprobs=behaviour * mask,
        is_weights=truncated_importance_weights(logprobs, behaviour, mask, cfg.rollout.is_cap),
    )


def _assemble(pending, cfg: RunConfig, engine: RolloutEngine, pad_id: int) -> tuple[Experience, Tensor]:
    """Wait for each chunk's reference log-probs and scores and build the iteration's experience
    (behaviour log-probs and importance weights included) and rollout entropy."""
    parts, entropies = [], []
    for batch, logprobs, entropy, values, ref_future, score_future in pending:
        ref_logprobs = to_trainer(ref_future.result(), logprobs.device, width=batch.response_ids.shape[1])
        raw_scores = to_trainer(score_future.result(), logprobs.device)
        parts.append(build_experience(batch, logprobs, values, ref_logprobs, raw_scores, cfg,
                                      engine.shares_trainer_weights))
        entropies.append(entropy)
    width = max(e.shape[1] for e in entropies)
    entropy = torch.cat([torch.nn.functional.pad(e, (0, width - e.shape[1])) for e in entropies])
    return Experience.cat(parts, pad_id), entropy

"""Sampling and scoring one iteration's batch, overlapped: responses, reference log-probs, reward
scores, and the trainer's old log-probs, entropy and values.

Prompts are generated ``rollout.generation_chunk`` (default ``rollout.chunk_size``) at a time and scored
on the trainer ``rollout.chunk_size`` at a time; chunk k's reference log-probs and scores go to their
backends (CPU workers) before the trainer scores chunk k and generates chunk k+1, so the two overlap.
An out-of-memory error halves the chunk for the rest of the run (:class:`RolloutState`) and redoes it;
with per-sample seeds the samples do not depend on the chunk (:mod:`homerlhf.models.sampling`).
:class:`SyncRollouts` is the trainer's rollout source without ``rollout.async`` (:mod:`.asynchronous`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from homerlhf.config.schema import RunConfig
from homerlhf.memory.chunks import planned_generation_chunk
from homerlhf.memory.oom import halved_after_oom
from homerlhf.ppo.backends import Backends
from homerlhf.ppo.devices import to_trainer, worker_lists
from homerlhf.ppo.distributed import Ranks
from homerlhf.ppo.engines import HFEngine, RolloutEngine
from homerlhf.ppo.experience import Experience, Rollout
from homerlhf.ppo.importance import truncated_importance_weights
from homerlhf.ppo.meters import Meters
from homerlhf.ppo.rng import sample_seeds
from homerlhf.ppo.rollout import RolloutBatch, apply_truncation_penalty


@dataclass
class Prompts:
    """Tokenised prompts and, indexed alike, their dataset rows (for reward functions; None: none),
    their sampling seeds (None: torch's global generator) and, once taken from the run's, their indices."""

    ids: Sequence[Sequence[int]]
    rows: Optional[Sequence[dict]] = None
    seeds: Optional[Sequence[int]] = None
    indices: Optional[list[int]] = None

    def __post_init__(self) -> None:
        if self.rows is not None and len(self.rows) != len(self.ids):
            raise ValueError(f"{len(self.rows)} dataset rows for {len(self.ids)} prompts")

    def __len__(self) -> int:
        return len(self.ids)

    def take(self, indices: Sequence[int], seeds: Optional[Sequence[int]] = None) -> "Prompts":
        """The prompts at ``indices`` (and their rows), drawn with ``seeds``."""
        rows = [self.rows[i] for i in indices] if self.rows is not None else None
        return Prompts([self.ids[i] for i in indices], rows, seeds, list(indices))

    def after(self, start: int) -> "Prompts":
        """The prompts from ``start`` on."""
        return Prompts(self.ids[start:], None if self.rows is None else self.rows[start:],
                       None if self.seeds is None else self.seeds[start:])


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
        gen = planned_generation_chunk(cfg, shape) if shape is not None else None
    gen = gen or cfg.rollout.chunk_size
    return RolloutState(cfg.rollout.chunk_size, generation_chunk=None if gen == cfg.rollout.chunk_size else gen)


@torch.no_grad()
def score_with_policy(policy, batch: RolloutBatch) -> tuple[Tensor, Tensor, Tensor]:
    """Old log-probs, entropy and values of a rollout batch, each (B, T), without graphs."""
    policy.checkpoint_activations(False)
    input_ids, attention_mask = batch.sequences()
    logprobs, entropy, values = policy.actor_logprobs_and_values(input_ids, attention_mask, batch.response_ids.shape[1])
    return logprobs.detach(), entropy.detach(), values.detach()


def score_in_chunks(policy, batch: RolloutBatch, state: RolloutState) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`score_with_policy` over ``batch`` in pieces of ``state.chunk_size`` rows, halving it on OOM."""
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


def generate_chunk(engine: RolloutEngine, prompts: Prompts, cfg: RunConfig, state: RolloutState) -> RolloutBatch:
    """The rollout of the next ``state.generating`` of ``prompts`` by ``engine`` (fewer after an OOM:
    it halves)."""
    while True:
        n = min(len(prompts), state.generating)
        try:
            seeds = None if prompts.seeds is None else prompts.seeds[:n]
            return engine.generate(prompts.ids[:n], cfg.rollout, seeds=seeds)
        except BaseException as exc:  # noqa: BLE001 - halved_after_oom re-raises all but an OOM
            halved = halved_after_oom(exc, n, "generation")
            if state.generation_chunk is None:
                state.chunk_size = halved
            else:
                state.generation_chunk = halved
            state.oom_retries_generation += 1


def collect_experience(policy, prompts: Prompts, cfg: RunConfig, backends: Backends,
                       state: Optional[RolloutState] = None,
                       meters: Optional[Meters] = None) -> tuple[Experience, Tensor]:
    """Generate and score one iteration's batch, chunk by chunk, overlapping CPU scoring.

    ``backends``: the reference, the reward and the engine that samples (default: the actor's own
    ``generate``). ``state``: the chunk sizes in use and the OOM redos (the trainer's, kept across
    iterations; default: a fresh one). Returns the experience (scores are the raw backend scores with
    the truncation penalty applied; behaviour log-probs and importance weights set; rewards and
    advantages not yet computed) and the rollout entropy (B, T).
    """
    meters = meters if meters is not None else Meters()
    engine = backends.engine if backends.engine is not None else HFEngine(policy)
    state = state if state is not None else rollout_state(cfg)
    pending, start = [], 0
    while start < len(prompts):
        with meters.stage("generation"):
            batch = generate_chunk(engine, prompts.after(start), cfg, state)
            batch = to_trainer(batch, policy.device)  # an engine of another device's rollout
        chunk_rows = prompts.rows[start : start + len(batch)] if prompts.rows is not None else None
        start += len(batch)
        prompt_lists, response_lists = worker_lists(batch)
        # Submitted before this chunk's own scoring and the next chunk's generation: they overlap.
        with meters.stage("scoring"):
            ref_future = backends.reference.submit_logprobs(prompt_lists, response_lists)
            score_future = backends.reward.submit_score(prompt_lists, response_lists, chunk_rows)
            logprobs, entropy, values = score_in_chunks(policy, batch, state)
        pending.append((batch, logprobs, entropy, values, ref_future, score_future))
    with meters.stage("reference_reward_wait", memory=False):
        return _assemble(pending, cfg, engine, policy.tokenizer.pad_token_id)


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


class SyncRollouts:
    """The trainer's rollout source without ``rollout.async``: each iteration samples its own batch, by
    the engine synced to the actor's current weights first (:class:`.asynchronous.RolloutsAhead` is
    the other, with the same methods)."""

    samples_ahead = False

    def __init__(self, policy, cfg: RunConfig, backends: Backends, prompts: Prompts, state: RolloutState,
                 meters: Meters, ranks: Ranks):
        self.policy, self.cfg, self.backends, self.prompts = policy, cfg, backends, prompts
        self.state, self.meters, self.ranks = state, meters, ranks

    def collect(self, iteration: int, draw: Callable[[], list[int]], last_iteration: int) -> Rollout:
        """Iteration ``iteration``'s rollout: this rank's slice of the prompts ``draw()`` picks, sampled
        from per-sample seeds and scored; each row's policy version is the updates applied so far."""
        with self.meters.stage("generation", memory=False):
            self.backends.engine.sync(self.policy)  # the engine's own copy of the actor, if it keeps one
        indices = draw()
        seeds = sample_seeds(self.cfg.seed, iteration, len(indices))
        lo, hi = self.ranks.shard(len(indices))  # this rank's slice of the global batch
        prompts = self.prompts.take(indices[lo:hi], seeds[lo:hi])
        exp, entropy = collect_experience(self.policy, prompts, self.cfg, self.backends, self.state, self.meters)
        version = torch.full((len(exp),), iteration - 1, dtype=torch.long, device=exp.device)
        return Rollout(replace(exp, policy_version=version), entropy, self.backends.reward.take_component_scores())

    def drop_iteration(self) -> None:
        """Nothing to undo: a dropped iteration's prompts are drawn again."""

    def checkpoint_files(self) -> None:
        return None  # nothing sampled ahead to save

    def restore_from(self, ckpt) -> None:
        """Nothing sampled ahead to restore."""

    def close(self) -> None:
        pass

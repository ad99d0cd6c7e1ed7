"""Stages 1 and 2 of a PPO iteration: rollout and scoring, overlapped.

Prompts are generated ``rollout.chunk_size`` at a time; chunk k's reference log-probs and scores
are submitted to their backends (CPU workers) before chunk k's old log-probs and values are
computed and chunk k+1 is generated, so CPU scoring runs while the GPU works.
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
from homerlhf.ppo.experience import Experience
from homerlhf.ppo.rollout import RolloutBatch, apply_truncation_penalty, generate_rollout


@dataclass
class StageTimes:
    """Wall seconds of each stage of one iteration (the ``time_*_s`` metrics)."""

    generation: float = 0.0
    scoring: float = 0.0
    reference_reward_wait: float = 0.0
    advantages: float = 0.0
    update: float = 0.0


def phase(meter, name: str):
    """``meter.phase(name)`` (peak memory of a phase), or nothing without a meter."""
    return meter.phase(name) if meter is not None else contextlib.nullcontext()


def _pad_right(rows: Sequence[Sequence[float]], width: int, device) -> Tensor:
    out = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.as_tensor(list(row), dtype=torch.float32)
    return out.to(device)


@torch.no_grad()
def score_with_policy(policy, batch: RolloutBatch) -> tuple[Tensor, Tensor, Tensor]:
    """Old log-probs, entropy and values of a rollout batch, each (B, T), without graphs."""
    policy.eval()
    input_ids, attention_mask = batch.sequences()
    logprobs, entropy, values = policy.actor_logprobs_and_values(input_ids, attention_mask, batch.response_ids.shape[1])
    return logprobs.detach(), entropy.detach(), values.detach()


def collect_experience(
    policy,
    prompts: Sequence[Sequence[int]],
    cfg: RunConfig,
    reference: ReferenceBackend,
    reward: RewardBackend,
    *,
    rows: Optional[Sequence[dict]] = None,
    meter=None,
    times: Optional[StageTimes] = None,
) -> tuple[Experience, Tensor]:
    """Generate and score one iteration's batch, chunk by chunk, overlapping CPU scoring.

    ``rows``: the dataset row of each prompt (indexed like ``prompts``), for reward functions.

    Returns the experience (scores are the raw backend scores with the truncation penalty
    applied; rewards and advantages not yet computed) and the rollout entropy (B, T).
    """
    times = times if times is not None else StageTimes()
    pending = []
    for start in range(0, len(prompts), cfg.rollout.chunk_size):
        chunk = prompts[start : start + cfg.rollout.chunk_size]
        chunk_rows = rows[start : start + cfg.rollout.chunk_size] if rows is not None else None
        t0 = time.perf_counter()
        with phase(meter, "generation"):
            batch = generate_rollout(policy, chunk, cfg.rollout)
        t1 = time.perf_counter()
        times.generation += t1 - t0
        prompt_lists, response_lists = batch.prompt_lists(), batch.response_lists()
        # Submitted before this chunk's own scoring and the next chunk's generation: they overlap.
        with phase(meter, "scoring"):
            ref_future = reference.submit_logprobs(prompt_lists, response_lists)
            score_future = reward.submit_score(prompt_lists, response_lists, chunk_rows)
            logprobs, entropy, values = score_with_policy(policy, batch)
        times.scoring += time.perf_counter() - t1
        pending.append((batch, logprobs, entropy, values, ref_future, score_future))

    t0 = time.perf_counter()
    parts, entropies = [], []
    for batch, logprobs, entropy, values, ref_future, score_future in pending:
        width = batch.response_ids.shape[1]
        ref_logprobs = _pad_right(ref_future.result(), width, logprobs.device)
        raw_scores = torch.as_tensor(score_future.result(), dtype=torch.float32, device=logprobs.device)
        mask = batch.response_mask.to(logprobs.device)
        parts.append(Experience(
            prompt_ids=batch.prompt_ids, prompt_mask=batch.prompt_mask,
            response_ids=batch.response_ids, response_mask=mask,
            logprobs=logprobs * mask, ref_logprobs=ref_logprobs * mask, values=values * mask,
            scores=apply_truncation_penalty(raw_scores, batch, cfg.rollout), raw_scores=raw_scores,
            truncated=batch.truncated,
        ))
        entropies.append(entropy)
    times.reference_reward_wait += time.perf_counter() - t0
    pad_id = policy.tokenizer.pad_token_id
    width = max(e.shape[1] for e in entropies)
    entropy = torch.cat([torch.nn.functional.pad(e, (0, width - e.shape[1])) for e in entropies])
    return Experience.cat(parts, pad_id), entropy

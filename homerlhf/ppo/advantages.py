"""Stage 3 of a PPO iteration: scores as they enter the rewards, KL-shaped rewards, GAE, whitening.

The math is :mod:`homerlhf.ppo.math`'s; these functions only chain it as the config says.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from torch import Tensor

from homerlhf.config.schema import PPOConfig, RunConfig
from homerlhf.ppo.experience import Experience
from homerlhf.ppo.distributed import Reduce, global_batch_moments, global_masked_whiten
from homerlhf.ppo.group import grpo_advantages, rloo_advantages
from homerlhf.ppo.math import gae, kl_penalized_rewards, masked_whiten
from homerlhf.ppo.running import RunningMoments, normalize_scores


def normalized_scores(scores: Tensor, ppo: PPOConfig, moments: RunningMoments,
                      reduce: Optional[Reduce] = None) -> Tensor:
    """Scores (B,) as they enter the rewards: running-normalised and/or clipped when configured.
    ``reduce``: a sum over data-parallel ranks (the normaliser then sees every rank's scores)."""
    if ppo.score_norm:
        if reduce is None:
            moments.update(scores)
        else:
            moments.merge(*global_batch_moments(scores, reduce))
        return normalize_scores(scores, moments.mean, moments.std, clip=ppo.score_clip)
    if ppo.score_clip is not None:
        return scores.clamp(-ppo.score_clip, ppo.score_clip)
    return scores


def compute_advantages(exp: Experience, ppo: PPOConfig, kl_coef: float, scores: Tensor,
                       reduce: Optional[Reduce] = None) -> Experience:
    """KL-shaped rewards -> GAE -> (optional) whitening. ``scores``: (B,) as they enter the rewards.
    ``reduce``: a sum over data-parallel ranks; the whitening then uses every rank's advantages."""
    mask = exp.response_mask
    rewards, kl = kl_penalized_rewards(scores, exp.old_logprobs, exp.ref_logprobs, mask, kl_coef, ppo.kl_estimator)
    advantages, returns = gae(rewards, exp.values, mask, ppo.gamma, ppo.lam)
    if ppo.whiten_advantages:
        advantages = (masked_whiten(advantages, mask) if reduce is None
                      else global_masked_whiten(advantages, mask, reduce))
    return replace(exp, rewards=rewards, kl=kl, advantages=advantages, returns=returns)


def experience_kl_estimator(cfg: RunConfig) -> str:
    """The estimator of ``Experience.kl``: k3 when the KL is a loss term (GRPO / RLOO), else
    ``ppo.kl_estimator`` (PPO's KL is always in the reward)."""
    return "k3" if cfg.kl_in_loss else cfg.ppo.kl_estimator


def compute_group_advantages(exp: Experience, cfg: RunConfig, kl_coef: float, scores: Tensor) -> Experience:
    """GRPO / RLOO: each response's sequence reward (the score, minus ``kl_coef`` times its summed KL
    when the KL goes in the reward), turned into an advantage by its group (rows ``[g * n, (g + 1) * n)``
    hold one prompt's ``n = group.size`` responses): ``sequence_advantages`` (B,), the one the loss
    reads for every token of the response. No values, no returns, no per-token ``advantages``.

    With the KL in the loss (``cfg.kl_in_loss``) the rewards carry no KL and ``kl`` is the k3 estimate
    the loss penalises, kept for the metrics and the KL controller.
    """
    mask = exp.response_mask
    rewards, kl = kl_penalized_rewards(scores, exp.old_logprobs, exp.ref_logprobs, mask,
                                       0.0 if cfg.kl_in_loss else kl_coef, experience_kl_estimator(cfg))
    sequence_rewards = rewards.sum(dim=1)
    if cfg.algorithm == "grpo":
        advantages = grpo_advantages(sequence_rewards, cfg.group.size, scale_std=not cfg.group.dr_grpo)
    else:
        advantages = rloo_advantages(sequence_rewards, cfg.group.size)
    return replace(exp, rewards=rewards, kl=kl, returns=None, sequence_advantages=advantages.to(exp.old_logprobs.dtype))


def sequence_kl(exp: Experience) -> Tensor:
    """(B,) each response's summed per-token KL estimate: what the KL controller and ``kl_mean`` see."""
    return (exp.kl * exp.response_mask).sum(dim=1)

"""Stage 3 of a PPO iteration: scores as they enter the rewards, KL-shaped rewards, GAE, whitening.

The math is :mod:`homerlhf.ppo.math`'s; these functions only chain it as the config says.
"""

from __future__ import annotations

from torch import Tensor

from homerlhf.config.schema import PPOConfig
from homerlhf.ppo.experience import Experience
from homerlhf.ppo.math import gae, kl_penalized_rewards, masked_whiten
from homerlhf.ppo.running import RunningMoments, normalize_scores


def normalized_scores(scores: Tensor, ppo: PPOConfig, moments: RunningMoments) -> Tensor:
    """Scores (B,) as they enter the rewards: running-normalised and/or clipped when configured."""
    if ppo.score_norm:
        moments.update(scores)
        return normalize_scores(scores, moments.mean, moments.std, clip=ppo.score_clip)
    if ppo.score_clip is not None:
        return scores.clamp(-ppo.score_clip, ppo.score_clip)
    return scores


def compute_advantages(exp: Experience, ppo: PPOConfig, kl_coef: float, scores: Tensor) -> Experience:
    """KL-shaped rewards -> GAE -> (optional) whitening. ``scores``: (B,) as they enter the rewards."""
    mask = exp.response_mask
    rewards, kl = kl_penalized_rewards(scores, exp.logprobs, exp.ref_logprobs, mask, kl_coef, ppo.kl_estimator)
    advantages, returns = gae(rewards, exp.values, mask, ppo.gamma, ppo.lam)
    if ppo.whiten_advantages:
        advantages = masked_whiten(advantages, mask)
    return Experience(**{**exp.__dict__, "rewards": rewards, "kl": kl, "advantages": advantages, "returns": returns})


def sequence_kl(exp: Experience) -> Tensor:
    """(B,) each response's summed per-token KL estimate: what the KL controller and ``kl_mean`` see."""
    return (exp.kl * exp.response_mask).sum(dim=1)

"""Importance-sampling correction for rollouts sampled by an engine that is not the trainer.

The PPO ratio keeps the trainer's own recomputed old log-probs (``pi_old``). A rollout engine
whose weights are a copy (a llama.cpp export, another precision, a LoRA adapter of the previous
version) samples from a behaviour policy ``mu`` that differs from ``pi_old``; each token's policy
loss is then weighted by the truncated importance ratio ``w = min(pi_old / mu, cap)``
(truncated IS: bounded variance, bias only where ``mu`` under-samples by more than ``cap``).

Pure tensor functions, in the manner of :mod:`homerlhf.ppo.math`: shapes ``[B, T]``, and values at
masked positions never reach arithmetic (replaced by zeros first).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from homerlhf.ppo.math import _bool_mask, _check_shapes, masked_mean, policy_loss

__all__ = ["truncated_importance_weights", "weighted_policy_loss", "importance_metrics"]


def truncated_importance_weights(old_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor,
                                 cap: Optional[float]) -> Tensor:
    """``w = min(exp(old - behaviour), cap)`` on response tokens, 0 on padding.

    Args:
        old_logprobs: ``[B, T]`` the trainer's log-probs of the sampled tokens before the update.
        behaviour_logprobs: ``[B, T]`` the sampler's log-probs of the same tokens.
        mask: ``[B, T]`` response mask.
        cap: the truncation ``C`` (>= 1); None turns the correction off: every weight is 1.

    Returns: ``[B, T]`` float weights, no graph.
    """
    _check_shapes(old_logprobs, behaviour_logprobs=behaviour_logprobs, mask=mask)
    mask = _bool_mask(mask)
    zero = torch.zeros((), dtype=old_logprobs.dtype, device=old_logprobs.device)
    if cap is None:
        return mask.to(old_logprobs.dtype)
    log_ratio = torch.where(mask, old_logprobs.detach(), zero) - torch.where(mask, behaviour_logprobs.detach(), zero)
    weights = torch.clamp(torch.exp(log_ratio), max=float(cap))
    return torch.where(mask, weights, zero)


def weighted_policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, weights: Optional[Tensor],
                         mask: Tensor, clip_range: float) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`homerlhf.ppo.math.policy_loss` with each token's term weighted by ``weights``.

    ``loss = masked_mean(w * max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps)))``. Since ``w > 0``,
    ``w * max(x, y) = max(w * x, w * y)``: this is ``policy_loss`` with advantages ``w * A``, and
    its clip fraction and approx_kl (which do not depend on ``A``'s scale) are unchanged.

    Args:
        logprobs, old_logprobs, advantages, mask: as ``policy_loss``, ``[B, T]``.
        weights: ``[B, T]`` importance weights (> 0 on response tokens), or None for all 1.
        clip_range: eps.

    Returns: ``(loss, clipfrac, approx_kl)``, scalars, as ``policy_loss``.
    """
    if weights is None:
        return policy_loss(logprobs, old_logprobs, advantages, mask, clip_range)
    _check_shapes(advantages, weights=weights, mask=mask)
    bool_mask = _bool_mask(mask)
    zero = torch.zeros((), dtype=advantages.dtype, device=advantages.device)
    weighted = torch.where(bool_mask, advantages, zero) * torch.where(bool_mask, weights.to(advantages.dtype), zero)
    return policy_loss(logprobs, old_logprobs, weighted, mask, clip_range)


@torch.no_grad()
def importance_metrics(old_logprobs: Tensor, behaviour_logprobs: Tensor, weights: Tensor,
                       mask: Tensor) -> dict[str, Tensor]:
    """How far the sampler was from the trainer, over response tokens (scalars).

    - ``is_weight_mean`` / ``is_weight_max``: of the (truncated) weights.
    - ``is_capped_fraction``: tokens whose ratio ``exp(old - behaviour)`` exceeded the cap
      (their weight is below the ratio).
    - ``kl_behaviour_old``: k3 estimate of KL(behaviour || trainer old) per token, from tokens the
      behaviour policy sampled: with ``r = pi_old / mu``, ``(r - 1) - log r`` (>= 0).
    """
    _check_shapes(old_logprobs, behaviour_logprobs=behaviour_logprobs, weights=weights, mask=mask)
    mask = _bool_mask(mask)
    zero = torch.zeros((), dtype=old_logprobs.dtype, device=old_logprobs.device)
    log_ratio = torch.where(mask, old_logprobs, zero) - torch.where(mask, behaviour_logprobs, zero)
    ratio = torch.exp(log_ratio)
    weights = torch.where(mask, weights.to(old_logprobs.dtype), zero)
    return {
        "is_weight_mean": masked_mean(weights, mask),
        "is_weight_max": torch.where(mask, weights, torch.full_like(weights, float("-inf"))).max(),
        "is_capped_fraction": masked_mean((weights < ratio).to(old_logprobs.dtype), mask),
        "kl_behaviour_old": masked_mean((ratio - 1.0) - log_ratio, mask),
    }

"""The PPO math: pure tensor functions, nothing else.

No config objects, no devices, no I/O; the trainer calls these and never re-derives them.

Shapes: ``B`` batch, ``T`` response length. ``mask`` is 1 (or True) on response tokens and 0 on
padding, bool or 0/1 float. Response tokens are one contiguous block per row (right padding, or
any offset); ``gae`` treats the position after a row's block as the end of the episode.

Every function that takes a mask reads nothing at masked positions: values there (padding garbage,
even inf/nan) change neither the result nor the gradients, because inputs are replaced by zeros
*before* any arithmetic.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "K3_LOG_RATIO_BOUND",
    "K3_MAX",
    "k3_kl",
    "kl_penalized_rewards",
    "gae",
    "policy_loss",
    "value_loss",
    "explained_variance",
    "truncation_penalized_scores",
]


def _bool_mask(mask: Tensor) -> Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def _check_shapes(reference: Tensor, **tensors: Tensor) -> None:
    # Broadcasting would silently turn a [B] vs [B, T] mix-up into wrong numbers.
    for name, t in tensors.items():
        if t.shape != reference.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(reference.shape)}")


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over the positions where ``mask`` is 1.

    Args:
        x: any shape, e.g. ``[B, T]``.
        mask: same shape as ``x``.
        dim: reduce this dimension only; ``None`` reduces everything to a scalar.

    Returns: a scalar (``dim=None``) or ``x`` with ``dim`` removed. A reduction over no
    unmasked positions is 0/0 = nan.
    """
    _check_shapes(x, mask=mask)
    mask = _bool_mask(mask)
    total = torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))
    count = mask.to(x.dtype)
    if dim is None:
        return total.sum() / count.sum()
    return total.sum(dim) / count.sum(dim)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of ``x`` over all positions where ``mask`` is 1 (a scalar).

    ``unbiased`` applies Bessel's correction n / (n - 1). With a single unmasked value the
    unbiased variance is undefined; it is returned as 0 (no spread seen) rather than nan.
    Raises ``ValueError`` if the mask is all zeros.
    """
    mask = _bool_mask(mask)
    count = mask.sum()
    if count.item() == 0:
        raise ValueError("masked_var: the mask selects no elements")
    mean = masked_mean(x, mask)
    centered = torch.where(mask, x - mean, torch.zeros((), dtype=x.dtype, device=x.device))
    var = (centered**2).sum() / count
    if unbiased and count.item() > 1:
        var = var * count / (count - 1)
    return var


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Normalise ``x`` to zero mean and unit variance over the unmasked positions.

    ``(x - mean) / sqrt(var + eps)`` with the masked mean and unbiased masked variance; with
    ``shift_mean=False`` the mean is added back (only the scale changes). Positions where
    ``mask`` is 0 are 0 in the result. Shape: same as ``x``.
    """
    mask = _bool_mask(mask)
    # Zero padding first: inf there would otherwise reach the gradient of the scale as 0 * inf.
    x = torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))
    mean = masked_mean(x, mask)
    var = masked_var(x, mask, unbiased=True)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask, whitened, torch.zeros((), dtype=x.dtype, device=x.device))


# k3's bounds, as verl's ``kl_penalty`` (low_var_kl): unbounded, k3 grows as exp(d) (docs/ppo_details.md,
# detail 4, has a GRPO run that read 40 nats). The cap binds first: k3 > 10 once the
# log-ratio d leaves about (-11, 2.61), so the bound on d never changes a value. It keeps exp(d)
# finite (exp(20) ~ 4.9e8 in fp32 / bf16, where exp overflows past ~88) so that the zero gradient of
# a capped token stays 0 in backward (0 * exp(d), not 0 * inf = nan).
K3_LOG_RATIO_BOUND = 20.0  # nats: ref_logp - logp is clamped to +-this before exp
K3_MAX = 10.0  # nats: the most one token's k3 reads


def k3_kl(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Per-token k3 estimate of KL(policy || reference), bounded (Schulman 2020; bounds as verl).

    ``d = clamp(ref_logp - logp, -K3_LOG_RATIO_BOUND, K3_LOG_RATIO_BOUND)``,
    ``kl_t = min(exp(d) - 1 - d, K3_MAX)``: >= 0, and inside the bounds exactly the unbounded k3.

    Args:
        logprobs: ``[B, T]`` log-probs of the taken tokens under the policy (with grad in a loss).
        ref_logprobs: ``[B, T]`` the same under the reference model.
        mask: ``[B, T]`` response mask.

    Returns:
        kl ``[B, T]``: ``kl_t``, 0 where mask is 0. Differentiable in ``logprobs``: ``1 - exp(d)``
            per token, and 0 for a clamped token (``torch.clamp``'s gradient outside its bounds, as
            verl's): the loss stops pulling on a token once its k3 exceeds ``K3_MAX``.
        clamped ``[B, T]`` bool: True on the response tokens whose k3 was capped (every token whose
            ``d`` hit the log-ratio bound is among them), False on padding.
    """
    _check_shapes(logprobs, ref_logprobs=ref_logprobs, mask=mask)
    mask = _bool_mask(mask)
    # log(p_ref / p) on response tokens only, so padding garbage never reaches exp().
    log_ratio = torch.where(mask, ref_logprobs - logprobs, torch.zeros((), dtype=logprobs.dtype,
                                                                         device=logprobs.device))
    log_ratio = torch.clamp(log_ratio, -K3_LOG_RATIO_BOUND, K3_LOG_RATIO_BOUND)
    kl = torch.expm1(log_ratio) - log_ratio
    return torch.clamp(kl, max=K3_MAX), mask & (kl.detach() > K3_MAX)


def kl_penalized_rewards(
    scores: Tensor,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    kl_coef: float | Tensor,
    estimator: str = "k1",
) -> tuple[Tensor, Tensor]:
    """Per-token rewards: a KL penalty on every response token plus the score on the last one.

    Args:
        scores: ``[B]`` reward-model score of each response.
        logprobs: ``[B, T]`` log-probs of the taken tokens under the policy that sampled them.
        ref_logprobs: ``[B, T]`` the same under the reference model.
        mask: ``[B, T]`` response mask.
        kl_coef: penalty weight beta.
        estimator: ``"k1"``: ``kl_t = logp - ref_logp`` (unbiased, can be negative);
            ``"k3"``: ``kl_t = exp(ref_logp - logp) - 1 - (ref_logp - logp)`` (unbiased for the
            sum's expectation, always >= 0, lower variance), bounded as :func:`k3_kl` (biased low
            on the capped tokens only).

    Returns:
        rewards ``[B, T]``: ``-kl_coef * kl_t``, plus ``scores[b]`` at the last position where
        ``mask[b]`` is 1 (a row with an empty mask gets no score); 0 where mask is 0.
        kl ``[B, T]``: ``kl_t``, 0 where mask is 0.
    """
    _check_shapes(logprobs, ref_logprobs=ref_logprobs, mask=mask)
    if scores.shape != logprobs.shape[:1]:
        raise ValueError(f"scores has shape {tuple(scores.shape)}, expected ({logprobs.shape[0]},)")
    mask = _bool_mask(mask)
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    if estimator == "k1":
        kl = -torch.where(mask, ref_logprobs - logprobs, zero)  # padding garbage never reaches the result
    elif estimator == "k3":
        kl, _ = k3_kl(logprobs, ref_logprobs, mask)
    else:
        raise ValueError(f"estimator must be 'k1' or 'k3', got {estimator!r}")
    rewards = -kl_coef * kl
    # Last response position of each row = the largest index where the mask is 1.
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, -1).amax(dim=1)
    has_response = last >= 0
    row_scores = torch.where(has_response, scores.to(rewards.dtype), zero)
    rewards = rewards.scatter_add(1, last.clamp(min=0).unsqueeze(1), row_scores.unsqueeze(1))
    return rewards, kl


def gae(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016), vectorised over the batch.

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` and ``A_t = delta_t + gamma * lam * A_{t+1}``, where
    the value and advantage after a row's last response token are 0 (the episode ends there).

    Args:
        rewards: ``[B, T]`` per-token rewards (e.g. from ``kl_penalized_rewards``).
        values: ``[B, T]`` critic values V(s_t) at the rollout.
        mask: ``[B, T]`` response mask; one contiguous block per row.
        gamma: discount; lam: GAE lambda.

    Returns: advantages ``[B, T]`` and returns ``[B, T]`` (``advantages + values``), both 0
    where mask is 0.
    """
    _check_shapes(rewards, values=values, mask=mask)
    mask = _bool_mask(mask)
    zero = torch.zeros((), dtype=rewards.dtype, device=rewards.device)
    # Zeroed padding makes V_{t+1} = 0 and A_{t+1} = 0 past each row's last token for free.
    rewards = torch.where(mask, rewards, zero)
    values = torch.where(mask, values, zero)
    next_value = torch.zeros_like(values[:, 0])
    next_advantage = torch.zeros_like(values[:, 0])
    advantages_reversed = []
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]  # [B]
        advantage = torch.where(mask[:, t], delta + gamma * lam * next_advantage, zero)
        advantages_reversed.append(advantage)
        next_value, next_advantage = values[:, t], advantage
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    returns = torch.where(mask, advantages + values, zero)
    return advantages, returns


def policy_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, clip_range: float
) -> tuple[Tensor, Tensor, Tensor]:
    """PPO clipped surrogate loss for the actor.

    ``ratio = exp(logp - old_logp)``;
    ``loss = masked_mean(max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps)))``.

    Args:
        logprobs: ``[B, T]`` log-probs of the taken tokens under the current policy (with grad).
        old_logprobs: ``[B, T]`` the same at rollout time.
        advantages: ``[B, T]``.
        mask: ``[B, T]`` response mask.
        clip_range: eps.

    Returns (all scalars; only ``loss`` carries a graph):
        loss.
        clipfrac: fraction of response tokens where the clipped term is strictly larger (those
            tokens give no gradient).
        approx_kl: k3 estimate of KL(old || new) from tokens sampled by the old policy:
            with ``r = p_new / p_old``, ``k3 = (r - 1) - log r`` (>= 0; Schulman 2020).
    """
    _check_shapes(logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    mask = _bool_mask(mask)
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    log_ratio = torch.where(mask, logprobs - old_logprobs, zero)
    advantages = torch.where(mask, advantages, zero)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    loss = masked_mean(torch.maximum(unclipped, clipped), mask)
    with torch.no_grad():
        clipfrac = masked_mean((clipped > unclipped).to(logprobs.dtype), mask)
        approx_kl = masked_mean((ratio - 1.0) - log_ratio, mask)
    return loss, clipfrac, approx_kl


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip_range_value: float
) -> tuple[Tensor, Tensor]:
    """PPO clipped value loss for the critic.

    ``V_clip = old_V + clip(V - old_V, -eps, eps)``;
    ``loss = 0.5 * masked_mean(max((V - R)^2, (V_clip - R)^2))``.

    Args:
        values: ``[B, T]`` current critic values (with grad).
        old_values: ``[B, T]`` values at rollout time.
        returns: ``[B, T]`` GAE returns.
        mask: ``[B, T]`` response mask.
        clip_range_value: eps.

    Returns (scalars; only ``loss`` carries a graph): loss, and clipfrac = fraction of response
    tokens where the clipped term is strictly larger.
    """
    _check_shapes(values, old_values=old_values, returns=returns, mask=mask)
    mask = _bool_mask(mask)
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    values = torch.where(mask, values, zero)
    old_values = torch.where(mask, old_values, zero)
    returns = torch.where(mask, returns, zero)
    values_clipped = old_values + torch.clamp(values - old_values, -clip_range_value, clip_range_value)
    unclipped = (values - returns) ** 2
    clipped = (values_clipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.maximum(unclipped, clipped), mask)
    with torch.no_grad():
        clipfrac = masked_mean((clipped > unclipped).to(values.dtype), mask)
    return loss, clipfrac


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """How much of the returns' variance the critic explains: ``1 - Var[R - V] / Var[R]``.

    Over the unmasked positions of ``values`` and ``returns`` (``[B, T]``). 1 is perfect, 0 is
    no better than a constant, negative is worse. When ``Var[R] == 0`` there is nothing to
    explain and the result is 0.0, so the metric is never nan. A scalar in the inputs' dtype,
    without a graph.
    """
    _check_shapes(values, returns=returns, mask=mask)
    with torch.no_grad():
        # The biased variance: the n / (n - 1) factors cancel in the ratio, and n = 1 is allowed.
        var_returns = masked_var(returns, mask, unbiased=False)
        var_residual = masked_var(returns - values, mask, unbiased=False)
        tiny = torch.finfo(var_returns.dtype).tiny
        ratio = var_residual / var_returns.clamp(min=tiny)
        return torch.where(var_returns > 0, 1.0 - ratio, torch.zeros_like(ratio))


def truncation_penalized_scores(scores: Tensor, truncated: Tensor, penalty: float | None) -> Tensor:
    """Replace the score of responses that hit the length cap without EOS by ``penalty``.

    Args:
        scores: ``[B]`` reward-model scores.
        truncated: ``[B]`` bool, True where the response ran out of tokens without EOS.
        penalty: the score those responses get; ``None`` leaves ``scores`` as they are.

    Returns: ``[B]`` new scores (``scores`` itself is not modified).
    """
    _check_shapes(scores, truncated=truncated)
    if penalty is None:
        return scores
    return torch.where(truncated.bool(), torch.full_like(scores, float(penalty)), scores)

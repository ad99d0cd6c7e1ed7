"""The critic-free math of GRPO and RLOO: pure tensor functions, nothing else.

Both sample ``group_size`` responses per prompt, the groups one after the other in a batch (rows
``[g * n, (g + 1) * n)`` are group ``g``). Each response gets one advantage from its group's sequence
rewards: GRPO (Shao et al. 2024) ``A_i = (r_i - mean(r)) / (std(r) + eps)`` (Dr. GRPO, Liu et al.
2025: no division), RLOO (Ahmadian et al. 2024) ``A_i = r_i - mean_{j != i} r_j``. The loss is PPO's
clipped ratio per token with that advantage; ``aggregate`` makes the per-token terms one number:
``token_mean`` (over all response tokens), ``seq_mean_token_mean`` (each response's token mean, then
the mean over responses: GRPO's paper) or ``constant`` (sum / (B * max_new_tokens): Dr. GRPO).
Shapes: ``B`` batch, ``T`` response length, ``mask`` 1 on response tokens; masked positions never
reach the arithmetic, as in :mod:`homerlhf.ppo.math`. docs/ppo_details.md, detail 19, derives them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from homerlhf.ppo.math import _bool_mask, _check_shapes, k3_kl

__all__ = [
    "AGGREGATIONS",
    "GroupLoss",
    "groups",
    "grpo_advantages",
    "rloo_advantages",
    "group_zero_spread",
    "token_advantages",
    "aggregate",
    "clipped_group_loss",
]

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "constant")


@dataclass(frozen=True)
class GroupLoss:
    """The settings of :func:`clipped_group_loss`."""

    clip_range: float  # the ratio's clip epsilon
    kl_coef: float  # the weight of the k3 KL to the reference per token; 0 keeps it out of the loss
    mode: str  # one of AGGREGATIONS
    max_len: int | None = None  # the ``constant`` aggregation's length (rollout.max_new_tokens)

    @property
    def per_row(self) -> bool:
        """True when the loss is a mean over rows (micro-batches weigh by rows, not tokens)."""
        return self.mode in ("seq_mean_token_mean", "constant")


def groups(x: Tensor, group_size: int) -> Tensor:
    """``[B]`` -> ``[B / group_size, group_size]``; refuses a batch that is not whole groups."""
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2, got {group_size}")
    if x.dim() != 1 or x.shape[0] % group_size:
        raise ValueError(f"expected a [B] tensor with B a multiple of {group_size}, got shape {tuple(x.shape)}")
    return x.reshape(-1, group_size)


def grpo_advantages(rewards: Tensor, group_size: int, scale_std: bool = True, eps: float = 1e-4) -> Tensor:
    """GRPO's advantage of each response (``[B]``): its reward minus its group's mean, divided by the
    group's unbiased std + ``eps`` when ``scale_std`` (off: Dr. GRPO). A group with no spread gives 0."""
    g = groups(rewards, group_size)
    centred = g - g.mean(dim=1, keepdim=True)
    if scale_std:
        centred = centred / (g.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)


def rloo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """RLOO's advantage of each response (``[B]``): its reward minus the mean of the *other*
    ``group_size - 1`` rewards of its group."""
    g = groups(rewards, group_size)
    others = (g.sum(dim=1, keepdim=True) - g) / (group_size - 1)
    return (g - others).reshape(-1)


def group_zero_spread(rewards: Tensor, group_size: int) -> Tensor:
    """Fraction of groups whose rewards are all equal (no learning signal from them): a scalar."""
    g = groups(rewards, group_size)
    return (g.amax(dim=1) == g.amin(dim=1)).to(rewards.dtype).mean()


def token_advantages(advantages: Tensor, mask: Tensor) -> Tensor:
    """A sequence advantage ``[B]`` on every response token of its row: ``[B, T]``, 0 off the mask."""
    mask = _bool_mask(mask)
    if advantages.shape != mask.shape[:1]:
        raise ValueError(f"advantages has shape {tuple(advantages.shape)}, expected ({mask.shape[0]},)")
    return torch.where(mask, advantages.unsqueeze(1).to(torch.float32), torch.zeros((), device=mask.device))


def aggregate(per_token: Tensor, mask: Tensor, mode: str, max_len: int | None = None) -> Tensor:
    """One scalar from per-token terms ``[B, T]`` (see the module docstring for the three ``mode``s);
    ``constant`` divides by ``B * max_len``."""
    _check_shapes(per_token, mask=mask)
    mask = _bool_mask(mask)
    terms = torch.where(mask, per_token, torch.zeros((), dtype=per_token.dtype, device=per_token.device))
    if mode == "token_mean":
        return terms.sum() / mask.sum().clamp(min=1)
    if mode == "seq_mean_token_mean":
        return (terms.sum(dim=1) / mask.sum(dim=1).clamp(min=1)).mean()
    if mode == "constant":
        if not max_len:
            raise ValueError("aggregate mode 'constant' needs max_len")
        return terms.sum() / (per_token.shape[0] * max_len)
    raise ValueError(f"aggregate mode must be one of {AGGREGATIONS}, got {mode!r}")


def clipped_group_loss(logprobs: Tensor, old_logprobs: Tensor, ref_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                       loss: GroupLoss, weights: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """The GRPO/RLOO actor loss: PPO's clipped ratio term per token with the sequence advantages, plus
    ``loss.kl_coef`` times the bounded k3 KL to the reference per token (:func:`homerlhf.ppo.math.k3_kl`:
    a token whose k3 is capped gives no KL gradient), aggregated by ``loss.mode``.

    Args: ``logprobs`` ``[B, T]`` with grad; ``old_logprobs``, ``ref_logprobs`` ``[B, T]``;
    ``advantages`` ``[B]`` (one per sequence); ``mask`` ``[B, T]``; ``weights`` ``[B, T]`` importance
    weights of the clipped term (:mod:`homerlhf.ppo.importance`; None: all 1).

    Returns the loss (with graph) and its stats (no graph): ``clipfrac``, ``approx_kl`` (k3 of
    KL(old || new), as PPO's), ``kl_ref`` (mean per-token k3 KL to the reference) and ``kl_clamped``
    (fraction of response tokens whose k3 was capped).
    """
    _check_shapes(logprobs, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, mask=mask)
    mask = _bool_mask(mask)
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    adv = token_advantages(advantages, mask).to(logprobs.dtype)
    log_ratio = torch.where(mask, logprobs - old_logprobs, zero)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - loss.clip_range, 1.0 + loss.clip_range)
    per_token = torch.maximum(unclipped, clipped)
    if weights is not None:  # w > 0: w * max(x, y) = max(w * x, w * y), the clip fraction is unchanged
        per_token = per_token * torch.where(mask, weights.to(per_token.dtype), zero)
    kl, kl_clamped = k3_kl(logprobs, ref_logprobs, mask)
    if loss.kl_coef:
        per_token = per_token + loss.kl_coef * kl
    total = aggregate(per_token, mask, loss.mode, loss.max_len)
    with torch.no_grad():
        count = mask.sum().clamp(min=1)
        stats = {
            "clipfrac": torch.where(mask, (clipped > unclipped).to(logprobs.dtype), zero).sum() / count,
            "approx_kl": torch.where(mask, (ratio - 1.0) - log_ratio, zero).sum() / count,
            "kl_ref": kl.detach().sum() / count,
            "kl_clamped": kl_clamped.to(logprobs.dtype).sum() / count,
        }
    return total, stats

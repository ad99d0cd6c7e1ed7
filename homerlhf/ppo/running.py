"""Running mean and standard deviation of the reward scores, for score normalisation.

Our own ~40 lines: torch has no running-moments helper, and the ones in RL libraries come
with their frameworks (torchrl, stable-baselines3) or are private (TRL).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor


class RunningMoments:
    """Mean and unbiased std of every value passed to ``update`` so far.

    Batches are merged with Chan et al.'s parallel algorithm (1979): exact for any batch sizes,
    and numerically stable because it tracks the sum of squared deviations ``m2`` rather than
    the sum of squares. State is kept in Python floats (float64).
    """

    def __init__(self) -> None:
        self.mean = 0.0
        self.m2 = 0.0
        self.count = 0

    @property
    def var(self) -> float:
        """Unbiased variance; 1.0 until two values have been seen (normalising is then a shift)."""
        return self.m2 / (self.count - 1) if self.count > 1 else 1.0

    @property
    def std(self) -> float:
        """Unbiased standard deviation; 1.0 until two values have been seen."""
        return math.sqrt(self.var)

    def update(self, x: Tensor) -> tuple[float, float]:
        """Fold in every element of ``x`` (any shape). Returns the batch's own mean and
        unbiased std (std 0.0 for a single value)."""
        n = x.numel()
        if n == 0:
            raise ValueError("RunningMoments.update: empty tensor")
        xs = x.detach().to(torch.float64).flatten()
        batch_mean = xs.mean().item()
        batch_m2 = ((xs - batch_mean) ** 2).sum().item()
        self.merge(n, batch_mean, batch_m2)
        batch_std = math.sqrt(batch_m2 / (n - 1)) if n > 1 else 0.0
        return batch_mean, batch_std

    def merge(self, n: int, batch_mean: float, batch_m2: float) -> None:
        """Fold in a batch given by its size, mean and sum of squared deviations (e.g. a batch spread
        over several processes: :func:`homerlhf.ppo.distributed.global_batch_moments`)."""
        if n <= 0:
            raise ValueError("RunningMoments.merge: empty batch")
        total = self.count + n
        delta = batch_mean - self.mean
        self.mean += delta * n / total
        self.m2 += batch_m2 + delta * delta * self.count * n / total
        self.count = total

    def state_dict(self) -> dict[str, Any]:
        return {"mean": self.mean, "m2": self.m2, "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.mean = float(state["mean"])
        self.m2 = float(state["m2"])
        self.count = int(state["count"])


def normalize_scores(scores: Tensor, mean: float, std: float, clip: float | None = None) -> Tensor:
    """``(scores - mean) / std``, then clipped to ``[-clip, clip]`` when ``clip`` is given.

    Shapes: ``scores`` any (``[B]`` in the trainer); the result has the same shape and dtype.
    A ``std`` below 1e-8 is treated as 1e-8 so a constant history cannot divide by zero.
    """
    if clip is not None and clip <= 0:
        raise ValueError(f"clip must be > 0, got {clip}")
    normalized = (scores - mean) / max(float(std), 1e-8)
    if clip is not None:
        normalized = normalized.clamp(-clip, clip)
    return normalized

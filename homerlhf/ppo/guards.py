"""The non-finite guard: a NaN/inf loss or gradient skips that optimizer step; N in a row stop the run.

One bad mini-batch (an overflow, a degenerate reward) should not poison the adapters or the
optimizer's moments, so the step is skipped and logged. A run that keeps producing them has
diverged; it stops with a clear message and without writing a checkpoint, so the last good
checkpoint is what ``--resume`` continues from.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Iterable, Mapping, Optional

import torch

from homerlhf.errors import UserError

log = logging.getLogger(__name__)


class NonFiniteError(UserError):
    """Too many non-finite steps in a row: the run stops (exit code 1)."""

    def __init__(self, message: str):
        super().__init__(message, exit_code=1)


def is_finite(value) -> bool:
    """True for a finite Python number or a tensor whose elements are all finite."""
    if isinstance(value, torch.Tensor):
        return bool(torch.isfinite(value).all())
    return math.isfinite(float(value))


def grads_finite(params: Iterable[torch.nn.Parameter]) -> bool:
    """Every existing ``.grad`` is finite (parameters without a gradient are ignored)."""
    return all(is_finite(p.grad) for p in params if p.grad is not None)


class NonFiniteGuard:
    """Counts optimizer steps with a non-finite loss or gradient norm.

    ``check(values)`` returns True when the step may be taken. On a bad step it logs, counts, and
    raises :class:`NonFiniteError` once ``max_in_row`` bad steps came in a row. ``last_checkpoint``
    is set by the trainer after each save, so the message can name what a resume would use.
    """

    def __init__(self, max_in_row: int):
        if max_in_row < 1:
            raise ValueError(f"max_in_row must be >= 1, got {max_in_row}")
        self.max_in_row = max_in_row
        self.in_row = 0
        self.skipped_total = 0
        self.last_checkpoint: Optional[Path] = None

    def check(self, values: Mapping[str, object], where: str = "") -> bool:
        bad = [name for name, value in values.items() if not is_finite(value)]
        if not bad:
            self.in_row = 0
            return True
        self.in_row += 1
        self.skipped_total += 1
        log.warning("non-finite %s%s: optimizer step skipped (%d in a row)",
                    ", ".join(bad), f" at {where}" if where else "", self.in_row)
        if self.in_row >= self.max_in_row:
            resume = (f"the last good checkpoint is {self.last_checkpoint}" if self.last_checkpoint
                      else "no checkpoint was written yet")
            raise NonFiniteError(
                f"training stopped: {self.in_row} optimizer steps in a row had a non-finite "
                f"{', '.join(bad)}; {resume}; lower actor.lr / critic.lr or check the reward model's scores, "
                "then continue with --resume"
            )
        return False

    def state_dict(self) -> dict[str, int]:
        return {"in_row": self.in_row, "skipped_total": self.skipped_total}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.in_row = int(state["in_row"])
        self.skipped_total = int(state["skipped_total"])

"""The run's guards: the non-finite guard and the KL-jump flag.

The non-finite guard: a NaN/inf loss or gradient skips that optimizer step; N in a row stop the run.
One bad mini-batch (an overflow, a degenerate reward) should not poison the adapters or the
optimizer's moments, so the step is skipped and logged. A run that keeps producing them has
diverged; it stops with a clear message and without writing a checkpoint, so the last good
checkpoint is what ``--resume`` continues from.

The KL-jump flag (:class:`KLJump`): an iteration whose KL to the reference rose past the run's whole
budget in one update, or whose update moved the policy past a bound, is flagged in its metrics row
(``kl_flag``, ``kl_jump``, ``kl_flag_reason``), hence in ``metrics.jsonl``, the trackers, the
progress line and the app's monitor, and in one warning line naming the likely cause and the
setting that stops it (``ppo.early_stop_kl``). It warns; it stops nothing.
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


# nats/token: the bound on an update's approx_kl when ppo.early_stop_kl is unset (docs/ppo_details.md:
# 0.001-0.05 is healthy, above 0.1 a step too large).
APPROX_KL_BOUND = 0.1


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def likely_cause(cfg, row: Mapping[str, object]) -> str:
    """The settings that make one update too large, with their values: the learning rate always, the
    epochs when the batch is trained more than once, the reward scale when scores are not normalised."""
    causes = [f"actor.lr {cfg.actor.lr:g} too high for this model"]
    if cfg.ppo.epochs > 1:
        causes.append(f"ppo.epochs {cfg.ppo.epochs} (each batch trained {cfg.ppo.epochs} times)")
    if not cfg.ppo.score_norm:
        std = row.get("score_std")
        causes.append("raw reward scale (ppo.score_norm false" + (f", score std {std:.2f})" if _finite(std) else ")"))
    return "likely cause: " + ", ".join(causes)


def stopping_setting(ppo) -> str:
    """The setting that stops an update once it has moved the policy far enough."""
    if ppo.early_stop_kl is None:
        return (f"set ppo.early_stop_kl={APPROX_KL_BOUND:g} (stops an update's epochs once approx_kl passes it) "
                "and lower actor.lr")
    return f"ppo.early_stop_kl is {ppo.early_stop_kl:g}: lower it, or lower actor.lr"


class KLJump:
    """Flags an iteration that left its reference in one update.

    ``check(row)`` (a metrics row, in iteration order) returns the row's additions: ``kl_jump``, its
    ``kl_mean`` minus the previous row's (from the second row on), ``kl_flag`` (1 when ``kl_jump``
    exceeds ``ppo.target_kl``, the run's KL budget, or ``approx_kl`` exceeds ``ppo.early_stop_kl``, or
    :data:`APPROX_KL_BOUND` when that is unset) and, when flagged, ``kl_flag_reason``: the line it
    also logs as a warning (when ``warn``). ``previous_kl`` travels in the checkpoint (the trainer's
    ``kl_previous``), so a resumed run's rows are the straight run's.
    """

    def __init__(self, cfg, warn: bool = True):
        self.cfg = cfg
        self.warn = warn
        self.previous_kl: Optional[float] = None

    def check(self, row: Mapping[str, object]) -> dict[str, object]:
        ppo = self.cfg.ppo
        kl, approx = row.get("kl_mean"), row.get("approx_kl")
        out: dict[str, object] = {}
        reasons = []
        if self.previous_kl is not None and _finite(kl):
            out["kl_jump"] = kl - self.previous_kl
            if out["kl_jump"] > ppo.target_kl:
                reasons.append(f"KL to the reference rose {out['kl_jump']:.2f} nats in one update "
                               f"({self.previous_kl:.2f} -> {kl:.2f} nats per response), past the run's budget "
                               f"ppo.target_kl={ppo.target_kl:g}")
        bound = ppo.early_stop_kl if ppo.early_stop_kl is not None else APPROX_KL_BOUND
        if _finite(approx) and approx > bound:
            reasons.append(f"the update moved the policy {approx:.3f} nats/token (approx_kl) from the one that "
                           f"sampled, past {bound:g}")
        if _finite(kl):
            self.previous_kl = float(kl)
        out["kl_flag"] = int(bool(reasons))
        if reasons:
            out["kl_flag_reason"] = (f"iteration {row.get('iteration')}: the policy is leaving its reference: "
                                     f"{'; '.join(reasons)}; {likely_cause(self.cfg, row)}; {stopping_setting(ppo)}")
            if self.warn:
                log.warning("%s", out["kl_flag_reason"])
        return out

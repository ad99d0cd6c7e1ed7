"""The run's guards: the non-finite guard, the KL-jump flag and the no-op guards.

- Non-finite (:class:`NonFiniteGuard`): a NaN/inf loss or gradient skips that optimizer step; N in a
  row stop the run without a checkpoint, so ``--resume`` continues from the last good one.
- KL jump (:class:`KLJump`): an iteration whose KL to the reference rose past the run's budget in one
  update is flagged in its metrics row (``kl_flag``, ``kl_jump``, ``kl_flag_reason``) and one warning
  line naming ``ppo.early_stop_kl``. It warns; it stops nothing.
- No-op (:class:`NoOpGuards`, ``guards:``): a run that learns nothing. A flat reward or all-zero
  advantages N iterations in a row, an update that left the LoRA weights as they were, every
  importance weight capped, every response empty N iterations in a row: each stops the run in one
  line (or warns, ``guards.action: warn``). Every response cut at the token cap warns once.
  docs/audit.md.
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
    """Flags an iteration that left its reference in one update, or crossed the run's KL budget.

    ``check(row)`` (a metrics row, in iteration order) returns the row's additions: ``kl_jump``, its
    ``kl_mean`` minus the previous row's (from the second row on), ``kl_flag`` (1 when ``kl_jump``
    exceeds ``ppo.target_kl``, the run's KL budget, or ``approx_kl`` exceeds ``ppo.early_stop_kl``, or
    :data:`APPROX_KL_BOUND` when that is unset, or ``kl_mean`` crossed ``ppo.target_kl`` by small
    updates: once a crossing, from at or under it to above) and, when flagged, ``kl_flag_reason``: the
    line it also logs as a warning (when ``warn``). ``previous_kl`` travels in the checkpoint (the
    trainer's ``kl_previous``), so a resumed run's rows are the straight run's.
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
        remedy = stopping_setting(ppo)
        crept = (not reasons and self.previous_kl is not None and _finite(kl)
                 and self.previous_kl <= ppo.target_kl < kl)
        if crept:  # no one update too large: the KL penalty did not hold the policy near its reference
            coef = row.get("kl_coef")
            reasons.append(f"KL to the reference reached {kl:.2f} nats per response ({self.previous_kl:.2f} the "
                           f"iteration before), past the run's budget ppo.target_kl={ppo.target_kl:g}, by updates "
                           "each under it")
            remedy = ("raise ppo.kl_coef" + (f" (this iteration's {coef:.3g})" if _finite(coef) else "")
                      + " or lower actor.lr")
        if _finite(kl):
            self.previous_kl = float(kl)
        out["kl_flag"] = int(bool(reasons))
        if reasons:
            out["kl_flag_reason"] = (f"iteration {row.get('iteration')}: the policy is leaving its reference: "
                                     f"{'; '.join(reasons)}; {likely_cause(self.cfg, row)}; {remedy}")
            if self.warn:
                log.warning("%s", out["kl_flag_reason"])
        return out


class NoOpError(UserError):
    """A no-op guard tripped: the run stops (exit code 1)."""

    def __init__(self, message: str):
        super().__init__(message, exit_code=1)


def weights_fingerprint(params: Iterable[torch.nn.Parameter]) -> torch.Tensor:
    """Per tensor, the float64 sum and sum of squares of its values, on the CPU: equal before and after
    an update only when the update left the weights as they were (or moved none past their rounding)."""
    sums = [torch.stack([p.detach().double().sum(), p.detach().double().square().sum()]) for p in params]
    return torch.stack(sums).cpu() if sums else torch.zeros(0, 2, dtype=torch.float64)


def all_advantages_zero(exp) -> bool:
    """Every advantage of the batch is 0 (GRPO/RLOO: per response; PPO: per response token)."""
    if exp.sequence_advantages is not None:
        return bool((exp.sequence_advantages == 0).all())
    if exp.advantages is not None:
        return bool((exp.advantages * exp.response_mask == 0).all())
    return False


def empty_responses(exp) -> torch.Tensor:
    """Per response (B,): it holds no token but its end token (or none at all)."""
    ended = ~exp.truncated.bool()
    return exp.response_mask.sum(dim=1) <= ended.long()


def empty_or_cut(exp) -> bool:
    """Every response of the batch was cut at the token cap, or holds no token but its end token."""
    return bool((exp.truncated.bool() | empty_responses(exp)).all())


class NoOpGuards:
    """The no-op guards of one run (``guards``). ``check(row, exp, before, after)`` after each
    iteration's row was written: ``row`` its metrics, ``exp`` its experience with advantages,
    ``before`` / ``after`` the actor's :func:`weights_fingerprint` around the update. Raises
    :class:`NoOpError` (or logs the line, with ``guards.action: warn``). The counts in a row travel
    in the checkpoint."""

    def __init__(self, cfg, warn: bool = True):
        self.cfg = cfg
        self.guards = cfg.guards
        self.warn = warn
        self.flat_in_row = 0
        self.empty_in_row = 0

    def check(self, row: Mapping[str, object], exp, before: Optional[torch.Tensor] = None,
              after: Optional[torch.Tensor] = None) -> None:
        causes = []
        flat = (len(exp) > 1 and bool((exp.scores == exp.scores[0]).all())) or all_advantages_zero(exp)
        self.flat_in_row = self.flat_in_row + 1 if flat else 0
        if self.flat_in_row >= self.guards.flat_reward_iterations:
            causes.append(f"the reward gave every response the same score ({float(exp.scores[0]):g}), or every advantage "
                          f"was 0, {self.flat_in_row} iterations in a row: nothing to learn from; check the reward "
                          "(a constant function, a saturated or broken reward model) or raise rollout.temperature")
        steps = int(row.get("optimizer_steps", 0)) - int(row.get("nonfinite_skipped_steps", 0))
        if (self.guards.lora_unchanged and not flat and steps > 0 and not row.get("critic_warmup")
                and before is not None and after is not None and torch.equal(before, after)):
            causes.append(f"the update took {steps} optimizer steps and left the actor's LoRA weights unchanged: "
                          f"check actor.lr ({self.cfg.actor.lr:g}), that the adapter is trainable and that its gradient "
                          "reaches it")
        capped = row.get("is_capped_fraction")
        if self.guards.all_capped and isinstance(capped, float) and capped >= 1.0:
            causes.append(f"every response token's importance weight was capped at rollout.is_cap "
                          f"({self.cfg.rollout.is_cap}): the rollout engine samples from another policy than the "
                          "trainer's; check the engine's adapter sync")
        cut = empty_or_cut(exp)
        self.empty_in_row = self.empty_in_row + 1 if cut else 0
        limit = self.guards.empty_or_cut_iterations
        if limit is not None and self.empty_in_row >= limit:
            if bool(empty_responses(exp).all()):  # nothing to score: a stop
                causes.append(f"every response was empty {self.empty_in_row} iterations in a row: the policy ends at once; "
                              "check the chat template and stop tokens")
            elif self.empty_in_row == limit and self.warn:  # cut answers are still scored: a warning, once a streak
                log.warning("iteration %s: every response was empty or cut at rollout.max_new_tokens (%d) %d iterations "
                            "in a row: the reward scores unfinished answers; raise rollout.max_new_tokens or check the "
                            "chat template and stop tokens", row.get("iteration"), self.cfg.rollout.max_new_tokens,
                            self.empty_in_row)
        if not causes:
            return
        line = f"iteration {row.get('iteration')}: training stopped: " + "; ".join(causes)
        if self.guards.action == "stop":
            raise NoOpError(line + " (guards.action=warn only warns)")
        if self.warn:
            log.warning("%s", line.replace("training stopped: ", "no-op guard: ", 1))

    def state_dict(self) -> dict[str, int]:
        return {"flat_in_row": self.flat_in_row, "empty_in_row": self.empty_in_row}

    def load_state_dict(self, state: Optional[Mapping[str, int]]) -> None:
        if state:
            self.flat_in_row = int(state["flat_in_row"])
            self.empty_in_row = int(state["empty_in_row"])

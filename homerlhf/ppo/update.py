"""The optimizer step of one mini-batch, around the loss the algorithm view computes
(:mod:`homerlhf.ppo.loop`): gradients accumulated over micro-batches (halved and redone after an
out-of-memory error), summed over data-parallel ranks, unscaled, clipped, checked, then stepped.

:class:`Updater` is the one object the update needs: the optimizers, the ``accelerate.Accelerator``
(backward and gradient clipping), the fp16 loss scaler, the non-finite guard, the ranks and the
mini-batch generator. Accumulation is by hand: each micro-batch's loss is weighted by its share of the
mini-batch, so a redo with smaller micro-batches gives the same step (:mod:`homerlhf.memory.oom`).
Forwards run without autocast, as at rollout; under fp16 compute a ``torch.amp.GradScaler``
(:func:`homerlhf.models.precision.loss_scaler`) scales the loss, and an overflow skips the step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from homerlhf.config.schema import RunConfig
from homerlhf.errors import UserError
from homerlhf.memory.oom import maybe_raise, run_with_backoff
from homerlhf.models.policy import compute_dtype
from homerlhf.models.precision import loss_scaler, unmixed_accelerator
from homerlhf.ppo.distributed import SINGLE, Ranks, merge_rows, owned_minibatch_rows
from homerlhf.ppo.experience import Experience
from homerlhf.ppo.guards import NonFiniteGuard

# ``micro_loss(micro, share)``: forward one micro-batch and backward its loss weighted by ``share``
# (its part of the mini-batch); returns the loss terms, 0-d tensors (:func:`homerlhf.ppo.loop.micro_batch_loss`).
MicroLoss = Callable[[Experience, Any], dict[str, Tensor]]


def build_optimizer(name: str, params: Sequence[torch.nn.Parameter], lr: float, weight_decay: float):
    """``adamw`` (torch, fp32 states; fused on CUDA: a few kernels a step for all the LoRA tensors) or
    bitsandbytes' ``adamw_8bit`` / ``paged_adamw_8bit`` (a quarter of the states' bytes, but one kernel
    and one ``torch.cuda.synchronize()`` per tensor a step: bitsandbytes/optim/optimizer.py, 0.50)."""
    params = list(params)
    if name == "adamw":
        fused = bool(params) and all(p.device.type == "cuda" for p in params)  # the CPU keeps torch's default
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused or None)
    import bitsandbytes as bnb  # late: ~2.5 s to import (measured), for the 8-bit optimizers alone

    if name == "adamw_8bit":
        return bnb.optim.AdamW8bit(params, lr=lr, weight_decay=weight_decay)
    if name == "paged_adamw_8bit":
        return bnb.optim.PagedAdamW8bit(params, lr=lr, weight_decay=weight_decay)
    raise UserError(f"unknown optimizer '{name}'; use adamw, adamw_8bit or paged_adamw_8bit")


@dataclass
class UpdateState:
    """What survives between mini-batch steps (and an OOM backoff)."""

    micro_batch_size: int
    oom_retries: int = 0
    history: list[dict[str, float]] = field(default_factory=list)


def _disabled_scaler() -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", enabled=False)


@dataclass
class Updater:
    """What the update needs besides the policy and the experience. ``critic_opt`` None: no critic
    (GRPO / RLOO). ``guard`` None: a non-finite step is taken. ``ranks``: data parallel, see
    :mod:`homerlhf.ppo.distributed`. ``generator``: the mini-batch shuffles'."""

    cfg: RunConfig
    accelerator: Any
    actor_opt: Any
    critic_opt: Any = None
    scaler: torch.amp.GradScaler = field(default_factory=_disabled_scaler)
    guard: Optional[NonFiniteGuard] = None
    ranks: Ranks = SINGLE
    generator: torch.Generator = field(default_factory=torch.Generator)
    state: Optional[UpdateState] = None  # None: a fresh one at ppo.micro_batch_size

    def __post_init__(self) -> None:
        if self.state is None:
            self.state = UpdateState(self.cfg.ppo.micro_batch_size)

    @classmethod
    def for_run(cls, cfg: RunConfig, policy, ranks: Ranks = SINGLE) -> "Updater":
        """The run's: optimizers of ``actor`` and ``critic``, the card's accelerator and scaler, the guard
        of ``training.max_nonfinite_steps``, mini-batches shuffled from ``seed``."""
        wd = cfg.training.weight_decay
        actor_opt = build_optimizer(cfg.actor.optimizer, policy.actor_parameters(), cfg.actor.lr, wd)
        critic_opt = (build_optimizer(cfg.critic.optimizer, policy.critic_parameters(), cfg.critic.lr, wd)
                      if cfg.has_critic else None)
        return cls(cfg, unmixed_accelerator(cpu=cfg.card.device == "cpu"), actor_opt, critic_opt,
                   scaler=loss_scaler(compute_dtype(cfg.quant, cfg.card.device), policy.device),
                   guard=NonFiniteGuard(cfg.training.max_nonfinite_steps), ranks=ranks,
                   generator=torch.Generator().manual_seed(cfg.seed))

    @property
    def optimizers(self) -> tuple:
        return tuple(opt for opt in (self.actor_opt, self.critic_opt) if opt is not None)

    def backward(self, loss: Tensor) -> None:
        self.accelerator.backward(self.scaler.scale(loss))

    def minibatches(self, exp: Experience) -> Iterator[tuple[Experience, int]]:
        """``(minibatch, global rows)`` pairs: shuffled mini-batches of ``ppo.mini_batch_size`` rows; data
        parallel, this rank's rows of each global mini-batch (one permutation on every rank)."""
        size = self.cfg.ppo.mini_batch_size
        if not self.ranks.distributed:
            for minibatch in exp.minibatches(size, self.generator):
                yield minibatch, len(minibatch)
            return
        lo, _ = self.ranks.shard(len(exp) * self.ranks.world)
        for owned, rows in owned_minibatch_rows(len(exp) * self.ranks.world, lo, lo + len(exp), size, self.generator):
            yield exp.select(owned).trimmed(), rows

    def step(self, minibatch: Experience, global_rows: int, micro_loss: MicroLoss, per_row: bool = False,
             critic_only: bool = False) -> dict[str, float]:
        """One optimizer step on ``minibatch``: ``micro_loss`` over its micro-batches (``per_row``: shares
        of rows, else of response tokens), redone with halved micro-batches after an OOM
        (``training.dynamic_micro_batch``), then the gradients summed over the ranks, unscaled and
        clipped. A non-finite loss or gradient norm (or an fp16 overflow) skips the step (``skipped``).
        ``critic_only``: the critic's optimizer alone steps (the actor's has no gradient to take)."""
        stats = self.accumulate(minibatch, global_rows, micro_loss, per_row)
        optimizers = (self.critic_opt,) if critic_only else self.optimizers
        if self.ranks.distributed:
            stats = _summed_over_ranks(self.ranks, optimizers, host_floats(stats))
        for optimizer in optimizers:
            self.scaler.unscale_(optimizer)  # clipping and the guard see the true gradients
        max_norm = self.cfg.ppo.max_grad_norm
        if not critic_only:
            stats["grad_norm_actor"] = self.accelerator.clip_grad_norm_(_params(self.actor_opt), max_norm)
        if self.critic_opt is not None:
            stats["grad_norm_critic"] = self.accelerator.clip_grad_norm_(_params(self.critic_opt), max_norm)
        stats = host_floats(stats)  # the mini-batch's one wait for the device
        checked = {k: stats[k] for k in ("policy_loss", "value_loss", "grad_norm_actor", "grad_norm_critic")
                   if k in stats}
        skip = _scale_overflow(self.scaler, stats) or (self.guard is not None and not self.guard.check(checked))
        for optimizer in optimizers:
            if skip:
                optimizer.zero_grad(set_to_none=True)
            else:
                self.scaler.step(optimizer)
        self.scaler.update()  # lowers the scale after an overflow
        stats["skipped"] = 1.0 if skip else 0.0
        self.state.history.append(stats)
        return stats

    def accumulate(self, minibatch: Experience, global_rows: int, micro_loss: MicroLoss,
                   per_row: bool = False) -> dict[str, Tensor]:
        """Zero the gradients, then ``micro_loss`` over every micro-batch at its share of the mini-batch:
        the accumulated gradient is the mini-batch's whatever the micro-batch size. The stats are 0-d
        tensors on the device: nothing here waits for it, so the next forward queues behind the last."""
        if self.ranks.distributed:  # this rank holds part of the mini-batch: shares of the whole of it
            total_tokens = self.ranks.sum(minibatch.response_mask.sum().double()).to(minibatch.response_mask.dtype)
        else:
            total_tokens, global_rows = minibatch.response_mask.sum(), len(minibatch)

        def accumulate(micro_batch_size: int) -> dict[str, Tensor]:
            for optimizer in self.optimizers:
                optimizer.zero_grad(set_to_none=True)
            stats: dict[str, Tensor] = {}
            for micro in minibatch.split(micro_batch_size):
                maybe_raise(micro_batch_size)
                share = len(micro) / global_rows if per_row else micro.response_mask.sum() / total_tokens
                for key, value in micro_loss(micro, share).items():
                    weighted = value.detach().float() * share
                    stats[key] = stats[key] + weighted if key in stats else weighted
            return stats

        if not self.cfg.training.dynamic_micro_batch:
            return accumulate(self.state.micro_batch_size)

        def on_retry(old: int, new: int, exc: BaseException) -> None:
            self.state.oom_retries += 1
            self.state.micro_batch_size = new

        return run_with_backoff(accumulate, self.state.micro_batch_size, on_retry=on_retry, phase="update")

    def summary(self, steps: list[dict[str, float]], early_stopped: bool) -> dict[str, float]:
        """The update's stats: each averaged over the steps taken (a skipped step's are NaN/inf), the
        steps, the skipped ones, the early stop and, under fp16, the loss scale after the last step."""
        taken = [s for s in steps if not s.get("skipped")] or steps
        out = {key: float(np.mean([s[key] for s in taken])) for key in steps[0] if key != "skipped"}
        out["optimizer_steps"] = len(steps)
        out["nonfinite_skipped_steps"] = sum(1 for s in steps if s.get("skipped"))
        out["early_stopped"] = int(early_stopped)
        if self.scaler.is_enabled():
            out["loss_scale"] = float(self.scaler.get_scale())
        return out


def _params(optimizer) -> list[torch.nn.Parameter]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def host_floats(stats: dict[str, Tensor | float]) -> dict[str, float]:
    """``stats`` as Python floats, the tensors among them read from their device in one transfer."""
    tensors = {k: v for k, v in stats.items() if torch.is_tensor(v)}
    out = {k: float(v) for k, v in stats.items() if not torch.is_tensor(v)}
    if tensors:
        values = torch.stack([v.detach().float().reshape(()) for v in tensors.values()]).tolist()
        out.update(zip(tensors, values))
    return {k: out[k] for k in stats}


def _scale_overflow(scaler: torch.amp.GradScaler, stats: dict[str, float]) -> bool:
    """An fp16 loss-scale overflow: finite losses but a non-finite gradient norm, at a scale above 1.

    That is the scaler's business (skip the step, halve the scale), not divergence. At a scale of 1
    or less a non-finite gradient is not the scale's doing, and the non-finite guard counts it.
    """
    if not scaler.is_enabled() or scaler.get_scale() <= 1.0:
        return False
    losses_finite = all(math.isfinite(stats[k]) for k in ("policy_loss", "value_loss") if k in stats)
    grads_finite = all(math.isfinite(stats[k]) for k in ("grad_norm_actor", "grad_norm_critic") if k in stats)
    return losses_finite and not grads_finite


def _summed_over_ranks(ranks: Ranks, optimizers, stats: dict[str, float]) -> dict[str, float]:
    """Data parallel: every rank's gradients and (share-weighted) loss stats summed; each rank then
    holds the global mini-batch's, as one process would."""
    ranks.all_reduce_grads([p for opt in optimizers for p in _params(opt)])
    return {key: sum(values) for key, values in merge_rows([{k: [v] for k, v in part.items()}
                                                            for part in ranks.gather(stats)]).items()}

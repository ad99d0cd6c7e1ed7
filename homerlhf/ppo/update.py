"""Stage 4 of a PPO iteration: K epochs of clipped updates over mini-batches, each accumulated
over micro-batches, with the OOM backoff and the non-finite guard.

Backward and gradient clipping go through ``accelerate.Accelerator`` (``backward``,
``clip_grad_norm_``). Gradient accumulation is done by hand in ``make_accumulate``: its loss
weighting must be exact for the OOM backoff to redo a step with smaller micro-batches.

Under fp16 compute a ``torch.amp.GradScaler`` (:func:`homerlhf.models.precision.loss_scaler`)
scales the loss before backward and unscales the fp32 gradients before clipping; an overflow
skips the step and lowers the scale. Forwards run without autocast, as at rollout, so the old and
new log-probs come from the same computation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from homerlhf.config.schema import PPOConfig, RunConfig
from homerlhf.errors import UserError
from homerlhf.ppo.advantages import sequence_advantages
from homerlhf.ppo.distributed import SINGLE, Ranks, merge_rows, owned_minibatch_rows
from homerlhf.ppo.experience import Experience
from homerlhf.ppo.group import clipped_group_loss
from homerlhf.ppo.guards import NonFiniteGuard
from homerlhf.ppo.importance import weighted_policy_loss
from homerlhf.ppo.math import masked_mean, value_loss


def build_optimizer(name: str, params: Sequence[torch.nn.Parameter], lr: float, weight_decay: float):
    """``adamw`` (torch, fp32 states; fused on CUDA: a few kernels a step for all the LoRA tensors) or
    bitsandbytes' ``adamw_8bit`` / ``paged_adamw_8bit`` (a quarter of the states' bytes, but one kernel
    and one ``torch.cuda.synchronize()`` per tensor a step: bitsandbytes/optim/optimizer.py, 0.50)."""
    params = list(params)
    if name == "adamw":
        fused = bool(params) and all(p.device.type == "cuda" for p in params)  # the CPU keeps torch's default
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused or None)
    import bitsandbytes as bnb

    if name == "adamw_8bit":
        return bnb.optim.AdamW8bit(params, lr=lr, weight_decay=weight_decay)
    if name == "paged_adamw_8bit":
        return bnb.optim.PagedAdamW8bit(params, lr=lr, weight_decay=weight_decay)
    raise UserError(f"unknown optimizer '{name}'; use adamw, adamw_8bit or paged_adamw_8bit")


def _losses(pg: tuple[Tensor, Tensor, Tensor], vf: tuple[Tensor, Tensor], entropy: Tensor,
            mask: Tensor) -> dict[str, Tensor]:
    """``policy_loss``'s and ``value_loss``'s results and the entropy, under their metric names."""
    (pg_loss, pg_clipfrac, approx_kl), (vf_loss, vf_clipfrac) = pg, vf
    return {
        "policy_loss": pg_loss, "value_loss": vf_loss, "policy_clipfrac": pg_clipfrac,
        "value_clipfrac": vf_clipfrac, "approx_kl": approx_kl, "entropy": masked_mean(entropy, mask),
    }


def micro_batch_losses(policy, micro: Experience, ppo: PPOConfig) -> dict[str, Tensor]:
    """Forward one micro-batch (one adapter for both); the policy and value losses (with graphs) and
    their stats."""
    input_ids, attention_mask = micro.sequences()
    logprobs, entropy, values = policy.actor_logprobs_and_values(input_ids, attention_mask, micro.response_len)
    mask = micro.response_mask
    return _losses(weighted_policy_loss(logprobs, micro.old_logprobs, micro.advantages, micro.is_weights, mask,
                                        ppo.clip_range),
                   value_loss(values, micro.values, micro.returns, mask, ppo.clip_range_value), entropy, mask)


@dataclass(frozen=True)
class GroupLoss:
    """What the critic-free (GRPO / RLOO) actor loss needs beyond the experience."""

    clip_range: float
    kl_coef: float  # 0 when the KL goes in the reward
    mode: str  # homerlhf.ppo.group.AGGREGATIONS
    max_len: int  # rollout.max_new_tokens, the ``constant`` aggregation's length

    @classmethod
    def from_config(cls, cfg: RunConfig, kl_coef: float) -> "GroupLoss":
        return cls(cfg.ppo.clip_range, kl_coef if cfg.kl_in_loss else 0.0, cfg.loss_aggregation,
                   cfg.rollout.max_new_tokens)

    @property
    def per_row(self) -> bool:
        """True when the loss is a mean over rows (micro-batches weigh by rows, not tokens)."""
        return self.mode in ("seq_mean_token_mean", "constant")


def group_micro_losses(policy, micro: Experience, group: GroupLoss) -> dict[str, Tensor]:
    """Forward one micro-batch through the actor; the GRPO / RLOO loss (with graph) and its stats."""
    input_ids, attention_mask = micro.sequences()
    logprobs, entropy = policy.actor_logprobs(input_ids, attention_mask, micro.response_len)
    mask = micro.response_mask
    loss, stats = clipped_group_loss(logprobs, micro.old_logprobs, micro.ref_logprobs, sequence_advantages(micro), mask,
                                     clip_range=group.clip_range, kl_coef=group.kl_coef, mode=group.mode,
                                     max_len=group.max_len, weights=micro.is_weights)
    return {"policy_loss": loss, "policy_clipfrac": stats["clipfrac"], "approx_kl": stats["approx_kl"],
            "kl_ref_loss": stats["kl_ref"], "kl_clamped_frac_loss": stats["kl_clamped"],
            "entropy": masked_mean(entropy, mask)}


def backward_separate_adapters(policy, micro: Experience, ppo: PPOConfig, backward: Callable[[Tensor], None],
                               share: Tensor) -> dict[str, Tensor]:
    """Actor forward and backward, then critic forward and backward, each loss weighted by ``share``.

    The two forwards are separate (different adapters); backward each at once so only one graph is
    alive at a time. Returns the losses and their stats.
    """
    input_ids, attention_mask = micro.sequences()
    mask = micro.response_mask
    logprobs, entropy = policy.actor_logprobs(input_ids, attention_mask, micro.response_len)
    pg = weighted_policy_loss(logprobs, micro.old_logprobs, micro.advantages, micro.is_weights, mask, ppo.clip_range)
    backward(pg[0] * share)
    values = policy.critic_values(input_ids, attention_mask, micro.response_len)
    vf = value_loss(values, micro.values, micro.returns, mask, ppo.clip_range_value)
    backward(vf[0] * share)
    return _losses(pg, vf, entropy, mask)


def make_accumulate(policy, minibatch: Experience, ppo: PPOConfig, optimizers, backward: Callable[[Tensor], None],
                    group: Optional[GroupLoss] = None, totals: Optional[tuple[Tensor, int]] = None):
    """``accumulate(micro_batch_size) -> stats``: zero grads, then forward/backward every micro-batch.

    Each micro-batch's (token-mean) losses are weighted by its share of the mini-batch's response
    tokens (its share of rows for a per-row ``group`` loss), so the accumulated gradient is the
    mini-batch's gradient whatever the micro-batch size: an OOM retry with halved micro-batches
    gives the same step. The optimizer step is the caller's (see ``homerlhf.memory.oom``).
    ``group``: the GRPO / RLOO loss (no critic); None for PPO. ``totals``: the response tokens and
    rows of the whole mini-batch when ``minibatch`` is this rank's part of it (data parallel).

    The stats are 0-d tensors on the policy's device (read by :func:`host_floats`, once a mini-batch)
    and the micro-batches' widths are read once: nothing here makes the host wait for the device, so
    the next forward is queued while the last one runs.
    """
    from homerlhf.memory.oom import maybe_raise

    total_tokens, total_rows = totals if totals is not None else (minibatch.response_mask.sum(), len(minibatch))

    def accumulate(micro_batch_size: int) -> dict[str, Tensor]:
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        stats: dict[str, Tensor] = {}
        for micro in minibatch.split(micro_batch_size):
            maybe_raise(micro_batch_size)
            share = micro.response_mask.sum() / total_tokens
            if group is not None:
                share = len(micro) / total_rows if group.per_row else share  # a Python float: no upload
                out = group_micro_losses(policy, micro, group)
                backward(out["policy_loss"] * share)
            elif policy.shared_adapter:
                out = micro_batch_losses(policy, micro, ppo)
                backward((out["policy_loss"] + ppo.vf_coef * out["value_loss"]) * share)
            else:
                out = backward_separate_adapters(policy, micro, ppo, backward, share)
            for key, value in out.items():
                weighted = value.detach().float() * share
                stats[key] = stats[key] + weighted if key in stats else weighted
        return stats

    return accumulate


def host_floats(stats: dict[str, Tensor | float]) -> dict[str, float]:
    """``stats`` as Python floats, the tensors among them read from their device in one transfer."""
    tensors = {k: v for k, v in stats.items() if torch.is_tensor(v)}
    out = {k: float(v) for k, v in stats.items() if not torch.is_tensor(v)}
    if tensors:
        values = torch.stack([v.detach().float().reshape(()) for v in tensors.values()]).tolist()
        out.update(zip(tensors, values))
    return {k: out[k] for k in stats}


@dataclass
class UpdateState:
    """What survives between mini-batch steps (and an OOM backoff)."""

    micro_batch_size: int
    oom_retries: int = 0
    history: list[dict[str, float]] = field(default_factory=list)


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
    """Data parallel: every rank's gradients and (token-share weighted) loss stats summed; each rank
    then holds the global mini-batch's. As they are with one process."""
    if not ranks.distributed:
        return stats
    ranks.all_reduce_grads([p for opt in optimizers for g in opt.param_groups for p in g["params"]])
    return {key: sum(values) for key, values in merge_rows([{k: [v] for k, v in part.items()}
                                                            for part in ranks.gather(stats)]).items()}


def train_minibatch(policy, minibatch: Experience, cfg: RunConfig, actor_opt, critic_opt, accelerator,
                    state: UpdateState, guard: Optional[NonFiniteGuard] = None,
                    scaler: Optional[torch.amp.GradScaler] = None,
                    group: Optional[GroupLoss] = None, ranks: Ranks = SINGLE,
                    global_rows: Optional[int] = None) -> dict[str, float]:
    """One optimizer step of actor and critic (actor alone: ``critic_opt`` None) on a mini-batch,
    accumulating over micro-batches.

    With a ``guard``, a non-finite loss or gradient norm skips the step (grads dropped, ``skipped``
    set in the stats); the guard raises once too many came in a row. ``scaler``: the fp16 loss
    scaler (None: no scaling); its overflows skip the step without counting as non-finite.
    Data parallel (``ranks``): ``minibatch`` is this rank's part of a mini-batch of ``global_rows``
    rows; the gradients and the loss stats are summed over the ranks before clipping, so every rank
    takes the same step.
    """
    optimizers = tuple(opt for opt in (actor_opt, critic_opt) if opt is not None)
    scaler = scaler if scaler is not None else torch.amp.GradScaler("cpu", enabled=False)

    def backward(loss: Tensor) -> None:
        accelerator.backward(scaler.scale(loss))

    totals = None
    if ranks.distributed:
        totals = (ranks.sum(minibatch.response_mask.sum().double()).to(minibatch.response_mask.dtype), global_rows)
    accumulate = make_accumulate(policy, minibatch, cfg.ppo, optimizers, backward, group, totals)
    if cfg.training.dynamic_micro_batch:
        from homerlhf.memory.oom import run_with_backoff

        def on_retry(old: int, new: int, exc: BaseException) -> None:
            state.oom_retries += 1
            state.micro_batch_size = new

        stats = run_with_backoff(accumulate, state.micro_batch_size, on_retry=on_retry, phase="update")
    else:
        stats = accumulate(state.micro_batch_size)
    if ranks.distributed:
        stats = _summed_over_ranks(ranks, optimizers, host_floats(stats))
    for optimizer in optimizers:
        scaler.unscale_(optimizer)  # clipping and the guard see the true gradients
    actor_params = [p for g in actor_opt.param_groups for p in g["params"]]
    stats["grad_norm_actor"] = accelerator.clip_grad_norm_(actor_params, cfg.ppo.max_grad_norm)
    if critic_opt is not None:
        critic_params = [p for g in critic_opt.param_groups for p in g["params"]]
        stats["grad_norm_critic"] = accelerator.clip_grad_norm_(critic_params, cfg.ppo.max_grad_norm)
    stats = host_floats(stats)  # the mini-batch's one wait for the device
    checked = ("policy_loss", "value_loss", "grad_norm_actor", "grad_norm_critic")
    if _scale_overflow(scaler, stats) or (guard is not None and not guard.check({k: stats[k] for k in checked
                                                                                 if k in stats})):
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        scaler.update()  # lowers the scale after an overflow
        stats["skipped"] = 1.0
        state.history.append(stats)
        return stats
    stats["skipped"] = 0.0
    for optimizer in optimizers:
        scaler.step(optimizer)
    scaler.update()
    state.history.append(stats)
    return stats


def ppo_update(policy, exp: Experience, cfg: RunConfig, actor_opt, critic_opt, accelerator,
               generator: torch.Generator, state: UpdateState, guard: Optional[NonFiniteGuard] = None,
               scaler: Optional[torch.amp.GradScaler] = None, group: Optional[GroupLoss] = None,
               ranks: Ranks = SINGLE) -> dict[str, float]:
    """K epochs of shuffled mini-batches; stops early once approx_kl exceeds ``ppo.early_stop_kl``.

    With an enabled fp16 ``scaler`` the stats include ``loss_scale``, its scale after the last step.
    ``group``: the GRPO / RLOO loss (``critic_opt`` None); None for PPO. ``ranks``: data parallel:
    ``exp`` is this rank's slice of the global batch (see :mod:`homerlhf.ppo.distributed`).
    """
    policy.checkpoint_activations(True)
    early_stopped = False
    steps = []
    for _ in range(cfg.ppo.epochs):
        for minibatch, rows in _minibatches(exp, cfg.ppo.mini_batch_size, generator, ranks):
            steps.append(train_minibatch(policy, minibatch, cfg, actor_opt, critic_opt, accelerator, state, guard,
                                         group=group, scaler=scaler, ranks=ranks, global_rows=rows))
            if cfg.ppo.early_stop_kl is not None and steps[-1]["approx_kl"] > cfg.ppo.early_stop_kl:
                early_stopped = True
                break
        if early_stopped:
            break
    policy.checkpoint_activations(False)
    taken = [s for s in steps if not s.get("skipped")] or steps  # skipped steps' stats are NaN/inf
    out = {key: float(np.mean([s[key] for s in taken])) for key in steps[0] if key != "skipped"}
    out["optimizer_steps"] = len(steps)
    out["nonfinite_skipped_steps"] = sum(1 for s in steps if s.get("skipped"))
    out["early_stopped"] = int(early_stopped)
    if scaler is not None and scaler.is_enabled():
        out["loss_scale"] = float(scaler.get_scale())
    return out


def _minibatches(exp: Experience, size: int, generator: torch.Generator, ranks: Ranks):
    """``(minibatch, global rows)`` pairs: shuffled mini-batches of ``exp``; data parallel, this rank's
    rows of each global mini-batch (one permutation of the global batch on every rank)."""
    if not ranks.distributed:
        for minibatch in exp.minibatches(size, generator):
            yield minibatch, len(minibatch)
        return
    lo, _ = ranks.shard(len(exp) * ranks.world)
    for owned, rows in owned_minibatch_rows(len(exp) * ranks.world, lo, lo + len(exp), size, generator):
        yield exp.select(owned).trimmed(), rows

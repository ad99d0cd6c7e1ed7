"""One iteration of RL from feedback (PPO, GRPO or RLOO), top to bottom: read this module first.

sample and score -> advantages -> update epochs over mini-batches -> KL controller -> log, each step a
call into pure functions (:mod:`.math`, :mod:`.group`, :mod:`.importance`, :mod:`.advantages`).

What wraps the steps is the ``run`` they are given, the trainer (:class:`homerlhf.ppo.trainer.RLTrainer`):
its rollout source (:mod:`.collect`; :mod:`.asynchronous` samples a batch ahead), the out-of-memory
redo (in the rollout, and in :class:`homerlhf.ppo.update.Updater`, which also sums gradients over
data-parallel ranks), the sum over ranks (``run.reduce``), the meters, the metrics row, checkpoints.
docs/ppo_details.md explains each detail of the algorithm and measures it.
"""

from __future__ import annotations

from contextlib import nullcontext
from functools import partial
from typing import Any, Callable, Optional, Protocol

import torch
from torch import Tensor

from homerlhf.config.schema import RunConfig
from homerlhf.ppo.advantages import compute_advantages, compute_group_advantages, normalized_scores, sequence_kl
from homerlhf.ppo.distributed import Reduce, mean_over_ranks
from homerlhf.ppo.experience import Experience, Rollout
from homerlhf.ppo.group import GroupLoss, clipped_group_loss
from homerlhf.ppo.importance import weighted_policy_loss
from homerlhf.ppo.math import masked_mean, value_loss
from homerlhf.ppo.update import Updater


class Run(Protocol):
    """What an iteration takes from the run around it (:class:`homerlhf.ppo.trainer.RLTrainer`)."""

    cfg: RunConfig
    policy: Any  # homerlhf.models.policy.PolicyModel
    iteration: int  # this one's number, from 1
    total_iterations: int  # the last one's: nothing is sampled ahead for after it
    rollouts: Any  # .collect.SyncRollouts or .asynchronous.RolloutsAhead: collect(iteration, draw, last) -> Rollout
    kl_controller: Any  # a .kl controller: .value, .update(kl, samples)
    score_moments: Any  # .running.RunningMoments of the scores
    reduce: Optional[Reduce]  # the sum over data-parallel ranks; None with one process
    ranks: Any  # .distributed.Ranks
    meters: Any  # .meters.Meters: stage times and memory phases
    updater: Updater
    next_indices: Callable[[], list[int]]  # the next batch's prompts, from the data cursor

    def stop_agreed(self) -> bool: ...

    def log(self, rollout: Rollout, exp: Experience, scores: Tensor, kl_coef: float,
            update: dict[str, float]) -> dict[str, Any]: ...


def iteration(run: Run) -> Optional[dict[str, Any]]:
    """One iteration on ``run`` (the trainer: what lives across iterations). Returns its metrics row,
    or None when a stop request came during the rollout (the trainer then drops the iteration)."""
    cfg, policy = run.cfg, run.policy
    # 1. Sample: responses to a batch of prompts, scored: the reference's log-probs, the reward's
    #    scores, the actor's own log-probs (old_logprobs) and, for PPO, the critic's values.
    rollout = run.rollouts.collect(run.iteration, run.next_indices, run.total_iterations)
    if run.stop_agreed():  # nothing the rollout made touched a weight: dropping it is exact
        return None
    kl_coef = float(run.kl_controller.value)
    # 2. Advantages: the scores as they enter the rewards, then GAE (PPO) or the group baseline.
    with run.meters.stage("advantages", memory=False):
        scores = normalized_scores(rollout.exp.scores, cfg.ppo, run.score_moments, run.reduce)
        exp = advantages(rollout.exp, scores, kl_coef, cfg, run.reduce)
    # 3. Update: epochs over shuffled mini-batches, one optimizer step each; in PPO's first
    #    critic.warmup_iterations, the critic's alone (the actor keeps its weights).
    critic_only = cfg.has_critic and run.iteration <= cfg.critic.warmup_iterations
    with run.meters.stage("update"):
        stats = update(policy, exp, run.updater, group_loss(cfg, kl_coef), critic_only)
    # 4. KL controller: the next iteration's coefficient, from this batch's KL to the reference.
    run.kl_controller.update(mean_over_ranks(sequence_kl(exp), run.reduce), len(exp) * run.ranks.world)
    # 5. Log: the metrics row of the whole batch (every rank's), written with its samples.
    return run.log(rollout, exp, scores, kl_coef, stats)


def advantages(exp: Experience, scores: Tensor, kl_coef: float, cfg: RunConfig,
               reduce: Optional[Reduce] = None) -> Experience:
    """``exp`` with its rewards, KL and advantages. ``scores`` (B,): as they enter the rewards.

    PPO: per-token rewards (the score on the last token, ``-kl_coef`` times the KL on each), GAE
    against the critic's values, whitened. GRPO / RLOO: each response's sequence reward against its
    group's, one advantage per response (no critic). ``reduce``: sum over data-parallel ranks."""
    if cfg.has_critic:
        return compute_advantages(exp, cfg.ppo, kl_coef, scores, reduce)
    return compute_group_advantages(exp, cfg, kl_coef, scores)


def group_loss(cfg: RunConfig, kl_coef: float) -> Optional[GroupLoss]:
    """GRPO / RLOO's loss settings, None for PPO: the k3 KL to the reference in the loss at ``kl_coef``
    (none when the KL went into the reward), per-token terms aggregated as configured."""
    if cfg.has_critic:
        return None
    return GroupLoss(cfg.ppo.clip_range, kl_coef if cfg.kl_in_loss else 0.0, cfg.loss_aggregation,
                     cfg.rollout.max_new_tokens)


def update(policy, exp: Experience, updater: Updater, group: Optional[GroupLoss] = None,
           critic_only: bool = False) -> dict[str, float]:
    """``ppo.epochs`` passes of shuffled mini-batches over ``exp``, one optimizer step each
    (:meth:`Updater.step`: micro-batches, clipping, guards), stopped once a step's ``approx_kl`` passes
    ``ppo.early_stop_kl``. ``group``: GRPO / RLOO's loss; None for PPO's. ``critic_only`` (PPO's critic
    warm-up): the value loss alone steps; the actor's terms are measured, not trained. Returns the stats."""
    ppo = updater.cfg.ppo
    loss = partial(micro_batch_loss, policy, updater=updater, group=group, critic_only=critic_only)
    per_row = group is not None and group.per_row  # a mean over rows: micro-batches weigh by their rows
    steps: list[dict[str, float]] = []
    early_stopped = False
    policy.checkpoint_activations(True)
    for _ in range(ppo.epochs):
        for minibatch, rows in updater.minibatches(exp):
            steps.append(updater.step(minibatch, rows, loss, per_row, critic_only))
            early_stopped = ppo.early_stop_kl is not None and steps[-1]["approx_kl"] > ppo.early_stop_kl
            if early_stopped:
                break
        if early_stopped:
            break
    policy.checkpoint_activations(False)
    stats = updater.summary(steps, early_stopped)
    if updater.critic_opt is not None:
        stats["critic_warmup"] = int(critic_only)
    return stats


def micro_batch_loss(policy, micro: Experience, share, updater: Updater,
                     group: Optional[GroupLoss] = None, critic_only: bool = False) -> dict[str, Tensor]:
    """Forward one micro-batch and backward its loss weighted by ``share`` (its part of the mini-batch);
    returns the loss terms (0-d tensors). The ratio is against ``old_logprobs``; each token's term is
    weighted by its importance weight (1 when the trainer's own module sampled). ``critic_only``: the
    actor's forward runs without a graph and only the value loss is backpropagated."""
    input_ids, attention_mask = micro.sequences()
    mask, width, backward = micro.response_mask, micro.response_len, updater.backward
    if group is not None:  # GRPO / RLOO: the actor alone, one advantage per response
        logprobs, entropy = policy.actor_logprobs(input_ids, attention_mask, width)
        loss, stats = clipped_group_loss(logprobs, micro.old_logprobs, micro.ref_logprobs, micro.sequence_advantages,
                                         mask, group, micro.is_weights)
        loss = with_router_aux(policy, loss)
        backward(loss * share)
        return {"policy_loss": loss, "policy_clipfrac": stats["clipfrac"], "approx_kl": stats["approx_kl"],
                "kl_ref_loss": stats["kl_ref"], "kl_clamped_frac_loss": stats["kl_clamped"],
                "entropy": masked_mean(entropy, mask)}
    ppo = updater.cfg.ppo
    if policy.shared_adapter:  # PPO, one adapter: one forward, one backward of both losses
        logprobs, entropy, values = policy.actor_logprobs_and_values(input_ids, attention_mask, width)
        pg = weighted_policy_loss(logprobs, micro.old_logprobs, micro.advantages, micro.is_weights, mask,
                                  ppo.clip_range)
        pg = (with_router_aux(policy, pg[0]), *pg[1:])
        vf = value_loss(values, micro.values, micro.returns, mask, ppo.clip_range_value)
        backward((pg[0] + ppo.vf_coef * vf[0]) * share)
    else:  # PPO, two adapters: actor then critic, each backward at once (one graph alive at a time)
        with torch.no_grad() if critic_only else nullcontext():
            logprobs, entropy = policy.actor_logprobs(input_ids, attention_mask, width)
            pg = weighted_policy_loss(logprobs, micro.old_logprobs, micro.advantages, micro.is_weights, mask,
                                      ppo.clip_range)
            pg = (with_router_aux(policy, pg[0]), *pg[1:])
        if not critic_only:
            backward(pg[0] * share)
        values = policy.critic_values(input_ids, attention_mask, width)
        vf = value_loss(values, micro.values, micro.returns, mask, ppo.clip_range_value)
        backward(vf[0] * share)
    (pg_loss, pg_clipfrac, approx_kl), (vf_loss, vf_clipfrac) = pg, vf
    return {"policy_loss": pg_loss, "value_loss": vf_loss, "policy_clipfrac": pg_clipfrac,
            "value_clipfrac": vf_clipfrac, "approx_kl": approx_kl, "entropy": masked_mean(entropy, mask)}


def with_router_aux(policy, loss: Tensor) -> Tensor:
    """The actor's loss plus its routers' weighted load-balancing loss (``ppo.router_aux_loss_coef`` of a
    mixture of experts), when its forward computed one."""
    aux = policy.take_router_aux_loss() if hasattr(policy, "take_router_aux_loss") else None
    return loss if aux is None else loss + aux

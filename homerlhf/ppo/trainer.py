"""The PPO loop: rollout -> scoring -> advantages -> K epochs of clipped updates -> metrics -> checkpoint.

Each stage is a named function that can be called and tested alone; ``PPOTrainer`` only holds the
state that lives across iterations (optimizers, KL controller, score normaliser, data cursor) and
calls them in order. The math comes from ``homerlhf.ppo.math``; nothing here re-derives it.

Overlap: prompts are generated ``rollout.chunk_size`` at a time; chunk k's reference log-probs and
scores are submitted to their backends (CPU workers) before chunk k's old log-probs and values are
computed and chunk k+1 is generated, so CPU scoring runs while the GPU works.

The loop runs under ``accelerate.Accelerator`` for device placement and backward (so it can later
be launched on several GPUs); gradient accumulation is done by hand in ``accumulate`` because its
loss weighting must be exact for the OOM backoff to redo a step with smaller micro-batches.
"""

from __future__ import annotations

import contextlib
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from homerlhf.config.schema import PPOConfig, RunConfig
from homerlhf.errors import UserError
from homerlhf.ppo.backends import ReferenceBackend, RewardBackend
from homerlhf.ppo.checkpoint import (
    capture_rng_state,
    checkpoint_name,
    load_checkpoint,
    save_checkpoint,
    truncate_logs,
)
from homerlhf.ppo.experience import Experience
from homerlhf.ppo.guards import NonFiniteGuard
from homerlhf.ppo.kl import build_kl_controller
from homerlhf.ppo.math import (
    explained_variance,
    gae,
    kl_penalized_rewards,
    masked_mean,
    masked_whiten,
    policy_loss,
    value_loss,
)
from homerlhf.ppo.metrics import MetricsWriter, progress_postfix
from homerlhf.ppo.rollout import RolloutBatch, apply_truncation_penalty, generate_rollout
from homerlhf.ppo.running import RunningMoments, normalize_scores
from homerlhf.ppo.stopping import StopRequested


# -- setup -------------------------------------------------------------------------------------
def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_optimizer(name: str, params: Sequence[torch.nn.Parameter], lr: float, weight_decay: float):
    """``adamw`` (torch, fp32 states) or bitsandbytes' ``adamw_8bit`` / ``paged_adamw_8bit``."""
    params = list(params)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    import bitsandbytes as bnb

    if name == "adamw_8bit":
        return bnb.optim.AdamW8bit(params, lr=lr, weight_decay=weight_decay)
    if name == "paged_adamw_8bit":
        return bnb.optim.PagedAdamW8bit(params, lr=lr, weight_decay=weight_decay)
    raise UserError(f"unknown optimizer '{name}'; use adamw, adamw_8bit or paged_adamw_8bit")


def _phase(meter, name: str):
    return meter.phase(name) if meter is not None else contextlib.nullcontext()


def _pad_right(rows: Sequence[Sequence[float]], width: int, device) -> Tensor:
    out = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.as_tensor(list(row), dtype=torch.float32)
    return out.to(device)


# -- stage 1+2: rollout and scoring ------------------------------------------------------------
@dataclass
class StageTimes:
    generation: float = 0.0
    scoring: float = 0.0
    reference_reward_wait: float = 0.0
    advantages: float = 0.0
    update: float = 0.0


@torch.no_grad()
def score_with_policy(policy, batch: RolloutBatch) -> tuple[Tensor, Tensor, Tensor]:
    """Old log-probs, entropy and values of a rollout batch, each (B, T), without graphs."""
    policy.eval()
    input_ids, attention_mask = batch.sequences()
    logprobs, entropy, values = policy.actor_logprobs_and_values(input_ids, attention_mask, batch.response_ids.shape[1])
    return logprobs.detach(), entropy.detach(), values.detach()


def collect_experience(
    policy,
    prompts: Sequence[Sequence[int]],
    cfg: RunConfig,
    reference: ReferenceBackend,
    reward: RewardBackend,
    *,
    meter=None,
    times: Optional[StageTimes] = None,
) -> tuple[Experience, Tensor]:
    """Generate and score one iteration's batch, chunk by chunk, overlapping CPU scoring.

    Returns the experience (scores are the raw backend scores with the truncation penalty
    applied; rewards and advantages not yet computed) and the rollout entropy (B, T).
    """
    times = times if times is not None else StageTimes()
    pending = []
    for start in range(0, len(prompts), cfg.rollout.chunk_size):
        chunk = prompts[start : start + cfg.rollout.chunk_size]
        t0 = time.perf_counter()
        with _phase(meter, "generation"):
            batch = generate_rollout(policy, chunk, cfg.rollout)
        t1 = time.perf_counter()
        times.generation += t1 - t0
        prompt_lists, response_lists = batch.prompt_lists(), batch.response_lists()
        # Submitted before this chunk's own scoring and the next chunk's generation: they overlap.
        with _phase(meter, "scoring"):
            ref_future = reference.submit_logprobs(prompt_lists, response_lists)
            score_future = reward.submit_score(prompt_lists, response_lists)
            logprobs, entropy, values = score_with_policy(policy, batch)
        times.scoring += time.perf_counter() - t1
        pending.append((batch, logprobs, entropy, values, ref_future, score_future))

    t0 = time.perf_counter()
    parts, entropies = [], []
    for batch, logprobs, entropy, values, ref_future, score_future in pending:
        width = batch.response_ids.shape[1]
        ref_logprobs = _pad_right(ref_future.result(), width, logprobs.device)
        raw_scores = torch.as_tensor(score_future.result(), dtype=torch.float32, device=logprobs.device)
        mask = batch.response_mask.to(logprobs.device)
        parts.append(Experience(
            prompt_ids=batch.prompt_ids, prompt_mask=batch.prompt_mask,
            response_ids=batch.response_ids, response_mask=mask,
            logprobs=logprobs * mask, ref_logprobs=ref_logprobs * mask, values=values * mask,
            scores=apply_truncation_penalty(raw_scores, batch, cfg.rollout), raw_scores=raw_scores,
            truncated=batch.truncated,
        ))
        entropies.append(entropy)
    times.reference_reward_wait += time.perf_counter() - t0
    pad_id = policy.tokenizer.pad_token_id
    width = max(e.shape[1] for e in entropies)
    entropy = torch.cat([torch.nn.functional.pad(e, (0, width - e.shape[1])) for e in entropies])
    return Experience.cat(parts, pad_id), entropy


# -- stage 3: scores, rewards, advantages ------------------------------------------------------
def normalized_scores(scores: Tensor, ppo: PPOConfig, moments: RunningMoments) -> Tensor:
    """Scores (B,) as they enter the rewards: running-normalised and/or clipped when configured."""
    if ppo.score_norm:
        moments.update(scores)
        return normalize_scores(scores, moments.mean, moments.std, clip=ppo.score_clip)
    if ppo.score_clip is not None:
        return scores.clamp(-ppo.score_clip, ppo.score_clip)
    return scores


def compute_advantages(exp: Experience, ppo: PPOConfig, kl_coef: float, scores: Tensor) -> Experience:
    """KL-shaped rewards -> GAE -> (optional) whitening. ``scores``: (B,) as they enter the rewards."""
    mask = exp.response_mask
    rewards, kl = kl_penalized_rewards(scores, exp.logprobs, exp.ref_logprobs, mask, kl_coef, ppo.kl_estimator)
    advantages, returns = gae(rewards, exp.values, mask, ppo.gamma, ppo.lam)
    if ppo.whiten_advantages:
        advantages = masked_whiten(advantages, mask)
    return Experience(**{**exp.__dict__, "rewards": rewards, "kl": kl, "advantages": advantages, "returns": returns})


# -- stage 4: the update -----------------------------------------------------------------------
def micro_batch_losses(policy, micro: Experience, ppo: PPOConfig) -> dict[str, Tensor]:
    """Forward one micro-batch; the policy and value losses (with graphs) and their stats."""
    input_ids, attention_mask = micro.sequences()
    logprobs, entropy, values = policy.actor_logprobs_and_values(input_ids, attention_mask, micro.response_len)
    mask = micro.response_mask
    pg_loss, pg_clipfrac, approx_kl = policy_loss(logprobs, micro.logprobs, micro.advantages, mask, ppo.clip_range)
    vf_loss, vf_clipfrac = value_loss(values, micro.values, micro.returns, mask, ppo.clip_range_value)
    return {
        "policy_loss": pg_loss, "value_loss": vf_loss, "policy_clipfrac": pg_clipfrac,
        "value_clipfrac": vf_clipfrac, "approx_kl": approx_kl, "entropy": masked_mean(entropy, mask),
    }


def make_accumulate(policy, minibatch: Experience, ppo: PPOConfig, optimizers, backward: Callable[[Tensor], None]):
    """``accumulate(micro_batch_size) -> stats``: zero grads, then forward/backward every micro-batch.

    Each micro-batch's (token-mean) losses are weighted by its share of the mini-batch's response
    tokens, so the accumulated gradient is the token-mean gradient of the whole mini-batch whatever
    the micro-batch size: an OOM retry with halved micro-batches gives the same step. The optimizer
    step is the caller's (see ``homerlhf.memory.oom``).
    """
    from homerlhf.memory.oom import maybe_raise

    total_tokens = minibatch.response_mask.sum()

    def accumulate(micro_batch_size: int) -> dict[str, float]:
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        stats: dict[str, float] = {}
        for micro in minibatch.split(micro_batch_size):
            maybe_raise(micro_batch_size)
            share = micro.response_mask.sum() / total_tokens
            if policy.shared_adapter:
                out = micro_batch_losses(policy, micro, ppo)
                backward((out["policy_loss"] + ppo.vf_coef * out["value_loss"]) * share)
            else:
                # Actor and critic forwards are separate (different adapters); backward each at once
                # so only one graph is alive at a time.
                input_ids, attention_mask = micro.sequences()
                mask = micro.response_mask
                logprobs, entropy = policy.actor_logprobs(input_ids, attention_mask, micro.response_len)
                pg_loss, pg_clipfrac, approx_kl = policy_loss(
                    logprobs, micro.logprobs, micro.advantages, mask, ppo.clip_range)
                backward(pg_loss * share)
                values = policy.critic_values(input_ids, attention_mask, micro.response_len)
                vf_loss, vf_clipfrac = value_loss(values, micro.values, micro.returns, mask, ppo.clip_range_value)
                backward(vf_loss * share)
                out = {"policy_loss": pg_loss, "value_loss": vf_loss, "policy_clipfrac": pg_clipfrac,
                       "value_clipfrac": vf_clipfrac, "approx_kl": approx_kl, "entropy": masked_mean(entropy, mask)}
            for key, value in out.items():
                stats[key] = stats.get(key, 0.0) + float(value.detach()) * float(share)
        return stats

    return accumulate


@dataclass
class UpdateState:
    """What survives between mini-batch steps (and an OOM backoff)."""

    micro_batch_size: int
    oom_retries: int = 0
    history: list[dict[str, float]] = field(default_factory=list)


def train_minibatch(policy, minibatch: Experience, cfg: RunConfig, actor_opt, critic_opt, accelerator,
                    state: UpdateState, guard: Optional[NonFiniteGuard] = None) -> dict[str, float]:
    """One optimizer step of actor and critic on a mini-batch (accumulating over micro-batches).

    With a ``guard``, a non-finite loss or gradient norm skips the step (grads dropped, ``skipped``
    set in the stats); the guard raises once too many came in a row.
    """
    optimizers = (actor_opt, critic_opt)
    accumulate = make_accumulate(policy, minibatch, cfg.ppo, optimizers, accelerator.backward)
    if cfg.training.dynamic_micro_batch:
        from homerlhf.memory.oom import run_with_backoff

        def on_retry(old: int, new: int, exc: BaseException) -> None:
            state.oom_retries += 1
            state.micro_batch_size = new

        stats = run_with_backoff(accumulate, state.micro_batch_size, on_retry=on_retry, phase="update")
    else:
        stats = accumulate(state.micro_batch_size)
    actor_params = [p for g in actor_opt.param_groups for p in g["params"]]
    critic_params = [p for g in critic_opt.param_groups for p in g["params"]]
    stats["grad_norm_actor"] = float(accelerator.clip_grad_norm_(actor_params, cfg.ppo.max_grad_norm))
    stats["grad_norm_critic"] = float(accelerator.clip_grad_norm_(critic_params, cfg.ppo.max_grad_norm))
    checked = ("policy_loss", "value_loss", "grad_norm_actor", "grad_norm_critic")
    if guard is not None and not guard.check({k: stats[k] for k in checked if k in stats}):
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        stats["skipped"] = 1.0
        state.history.append(stats)
        return stats
    stats["skipped"] = 0.0
    actor_opt.step()
    critic_opt.step()
    state.history.append(stats)
    return stats


def ppo_update(policy, exp: Experience, cfg: RunConfig, actor_opt, critic_opt, accelerator,
               generator: torch.Generator, state: UpdateState,
               guard: Optional[NonFiniteGuard] = None) -> dict[str, float]:
    """K epochs of shuffled mini-batches; stops early once approx_kl exceeds ``ppo.early_stop_kl``."""
    policy.train()
    early_stopped = False
    steps = []
    for _ in range(cfg.ppo.epochs):
        for minibatch in exp.minibatches(cfg.ppo.mini_batch_size, generator):
            steps.append(train_minibatch(policy, minibatch, cfg, actor_opt, critic_opt, accelerator, state, guard))
            if cfg.ppo.early_stop_kl is not None and steps[-1]["approx_kl"] > cfg.ppo.early_stop_kl:
                early_stopped = True
                break
        if early_stopped:
            break
    policy.eval()
    taken = [s for s in steps if not s.get("skipped")] or steps  # skipped steps' stats are NaN/inf
    out = {key: float(np.mean([s[key] for s in taken])) for key in steps[0] if key != "skipped"}
    out["optimizer_steps"] = len(steps)
    out["nonfinite_skipped_steps"] = sum(1 for s in steps if s.get("skipped"))
    out["early_stopped"] = int(early_stopped)
    return out


# -- the loop ----------------------------------------------------------------------------------
class PPOTrainer:
    """Holds cross-iteration state and runs ``iterations`` of PPO.

    ``prompts``: tokenised prompts (lists of ids), sampled without replacement in a seeded order.
    ``run_dir``: where metrics, samples and checkpoints go (None: keep metrics in memory only).
    """

    def __init__(self, cfg: RunConfig, policy, reference: ReferenceBackend, reward: RewardBackend,
                 prompts: Sequence[Sequence[int]], run_dir: Optional[str | Path] = None, *, accelerator=None,
                 stop: Optional[StopRequested] = None):
        from accelerate import Accelerator

        if not prompts:
            raise UserError("no prompts to train on: check data.prompts")
        self.cfg = cfg
        self.policy = policy
        self.reference = reference
        self.reward = reward
        self.prompts = [list(p) for p in prompts]
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.accelerator = accelerator or Accelerator(cpu=cfg.card.device == "cpu")
        wd = cfg.training.weight_decay
        self.actor_opt = build_optimizer(cfg.actor.optimizer, policy.actor_parameters(), cfg.actor.lr, wd)
        self.critic_opt = build_optimizer(cfg.critic.optimizer, policy.critic_parameters(), cfg.critic.lr, wd)
        self.kl_ctl = build_kl_controller(cfg.ppo)
        self.score_moments = RunningMoments()
        self.generator = torch.Generator().manual_seed(cfg.seed)  # mini-batch shuffles
        self.iteration = 0
        self.data_epoch = 0
        self.data_cursor = 0
        self.update_state = UpdateState(cfg.ppo.micro_batch_size)
        self.guard = NonFiniteGuard(cfg.training.max_nonfinite_steps)
        # The stage installs the signal handlers; a bare trainer only stops when asked in code.
        self.stop = stop if stop is not None else StopRequested()
        self.last_checkpoint: Optional[Path] = None
        self._iteration_start: Optional[tuple[dict[str, Any], dict[str, Any]]] = None
        self._dropped_iteration = False
        self.history: list[dict[str, Any]] = []
        self.writer = MetricsWriter(self.run_dir, cfg.logging.tensorboard) if self.run_dir else None
        from homerlhf.memory.peaks import PhaseMeter

        self.meter = PhaseMeter(policy.device)

    # Prompts come from a seeded permutation per pass over the data: (data_epoch, data_cursor)
    # pins the position, which is all a resume needs.
    def next_prompts(self) -> list[list[int]]:
        batch: list[list[int]] = []
        while len(batch) < self.cfg.rollout.batch_size:
            order = torch.randperm(len(self.prompts), generator=torch.Generator().manual_seed(
                self.cfg.seed * 1_000_003 + self.data_epoch))
            take = order[self.data_cursor : self.data_cursor + self.cfg.rollout.batch_size - len(batch)]
            batch.extend(self.prompts[i] for i in take.tolist())
            self.data_cursor += len(take)
            if self.data_cursor >= len(self.prompts):
                self.data_epoch, self.data_cursor = self.data_epoch + 1, 0
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {
            "iteration": self.iteration,
            "kl_controller": self.kl_ctl.state_dict(),
            "score_moments": self.score_moments.state_dict(),
            "data_epoch": self.data_epoch,
            "data_cursor": self.data_cursor,
            "micro_batch_size": self.update_state.micro_batch_size,
        }

    def _generators(self) -> dict[str, torch.Generator]:
        return {"minibatch": self.generator}

    def _optimizers(self) -> dict[str, Any]:
        return {"actor": self.actor_opt, "critic": self.critic_opt}

    def _stateful(self) -> dict[str, Any]:
        return {"kl_controller": self.kl_ctl, "score_moments": self.score_moments, "nonfinite_guard": self.guard}

    def _drop_iteration(self) -> None:
        _, counters = self._iteration_start
        self.iteration = counters["iteration"]
        self.data_epoch = counters["data_epoch"]
        self.data_cursor = counters["data_cursor"]
        self._dropped_iteration = True

    def step(self) -> Optional[dict[str, Any]]:
        """One iteration: rollout, scoring, advantages, update, metrics. Returns the metrics row,
        or None when a stop request arrived during rollout/scoring (the iteration is then dropped)."""
        cfg = self.cfg
        # Everything a checkpoint of "before this iteration" needs, should a stop drop the rest of it.
        self._iteration_start = (capture_rng_state(self._generators()), self.state_dict())
        self.iteration += 1
        self.meter.reset()
        times = StageTimes()
        started = time.perf_counter()
        exp, entropy = collect_experience(
            self.policy, self.next_prompts(), cfg, self.reference, self.reward, meter=self.meter, times=times)
        if self.stop.requested:
            # The rollout phase is over; the update would be a new one. Nothing it produced has
            # touched the weights, optimizers or normaliser yet, so dropping it is exact.
            self._drop_iteration()
            return None

        t0 = time.perf_counter()
        kl_coef = float(self.kl_ctl.value)
        scores = normalized_scores(exp.scores, cfg.ppo, self.score_moments)
        exp = compute_advantages(exp, cfg.ppo, kl_coef, scores)
        mask = exp.response_mask
        kl_per_seq = (exp.kl * mask).sum(dim=1)
        times.advantages = time.perf_counter() - t0

        t0 = time.perf_counter()
        retries_before = self.update_state.oom_retries
        with _phase(self.meter, "update"):
            update = ppo_update(self.policy, exp, cfg, self.actor_opt, self.critic_opt, self.accelerator,
                                self.generator, self.update_state, self.guard)
        times.update = time.perf_counter() - t0
        self.kl_ctl.update(float(kl_per_seq.mean()), len(exp))

        n_response = float(mask.sum())
        n_tokens = n_response + float(exp.prompt_mask.sum())
        row: dict[str, Any] = {
            "iteration": self.iteration,
            "score_mean": float(exp.scores.mean()),
            "score_std": float(exp.scores.std()) if len(exp) > 1 else 0.0,
            "score_used_mean": float(scores.mean()),
            "reward_mean": float((exp.rewards * mask).sum(dim=1).mean()),
            "kl_mean": float(kl_per_seq.mean()),
            "kl_per_token": float(masked_mean(exp.kl, mask)),
            "kl_coef": kl_coef,
            "entropy": float(masked_mean(entropy, mask)),
            "value_mean": float(masked_mean(exp.values, mask)),
            "return_mean": float(masked_mean(exp.returns, mask)),
            "policy_loss": update["policy_loss"],
            "value_loss": update["value_loss"],
            "policy_clipfrac": update["policy_clipfrac"],
            "value_clipfrac": update["value_clipfrac"],
            "approx_kl": update["approx_kl"],
            "explained_variance": float(explained_variance(exp.values, exp.returns, mask)),
            "grad_norm_actor": update["grad_norm_actor"],
            "grad_norm_critic": update["grad_norm_critic"],
            "optimizer_steps": update["optimizer_steps"],
            "nonfinite_skipped_steps": update["nonfinite_skipped_steps"],
            "early_stopped": update["early_stopped"],
            "micro_batch_size": self.update_state.micro_batch_size,
            "oom_retries": self.update_state.oom_retries - retries_before,
            "response_length_mean": float(mask.sum(dim=1).float().mean()),
            "truncated_fraction": float(exp.truncated.float().mean()),
            "time_generation_s": times.generation,
            "time_scoring_s": times.scoring,
            "time_reference_reward_wait_s": times.reference_reward_wait,
            "time_advantages_s": times.advantages,
            "time_update_s": times.update,
            "time_iteration_s": time.perf_counter() - started,
            "tokens_per_s_generation": n_response / max(times.generation, 1e-9),
            "tokens_per_s_scoring": n_tokens / max(times.scoring, 1e-9),
            "tokens_per_s_update": n_tokens * update["optimizer_steps"] * cfg.ppo.mini_batch_size
            / max(len(exp), 1) / max(times.update, 1e-9),
        }
        for name, gib in self.meter.peaks().items():
            row[f"peak_mem_{name}_gib"] = gib
        row["peak_mem_kind"] = self.meter.kind
        self.history.append(row)
        if self.writer is not None:
            self.writer.log(row)
            self.writer.log_samples(self.iteration, self.samples(exp))
        return row

    def samples(self, exp: Experience) -> list[dict[str, Any]]:
        """The first ``logging.samples_per_iteration`` generations as text, with their scores."""
        tok = self.policy.tokenizer
        out = []
        for i in range(min(self.cfg.logging.samples_per_iteration, len(exp))):
            out.append({
                "prompt": tok.decode(exp.prompt_ids[i][exp.prompt_mask[i].bool()], skip_special_tokens=False),
                "response": tok.decode(exp.response_ids[i][exp.response_mask[i].bool()], skip_special_tokens=True),
                "score": float(exp.scores[i]),
                "truncated": bool(exp.truncated[i]),
            })
        return out

    def checkpoint(self) -> Optional[Path]:
        """Write the full checkpoint of the state after ``self.iteration`` (see ``homerlhf.ppo.checkpoint``)."""
        if self.run_dir is None:
            return None
        rng_state = self._iteration_start[0] if self._dropped_iteration else None
        path = save_checkpoint(
            self.run_dir, self.iteration, policy=self.policy, optimizers=self._optimizers(), config=self.cfg,
            trainer_state=self.state_dict(), stateful=self._stateful(), rng_state=rng_state,
            generators=self._generators(), keep=self.cfg.checkpoint.keep,
        )
        self.last_checkpoint = self.guard.last_checkpoint = path
        return path

    def resume(self, ckpt: str | Path) -> int:
        """Continue from a checkpoint: weights, optimizers, controllers, RNG, data cursor; the run's
        logs are cut back to what they held at that checkpoint. Returns the iteration reached."""
        state = load_checkpoint(ckpt, policy=self.policy, optimizers=self._optimizers(),
                                stateful=self._stateful(), generators=self._generators())
        counters = state["trainer"]
        self.iteration = int(state["iteration"])
        self.data_epoch = int(counters["data_epoch"])
        self.data_cursor = int(counters["data_cursor"])
        self.update_state.micro_batch_size = int(counters.get("micro_batch_size", self.update_state.micro_batch_size))
        # load_state_dict brings back the saved learning rates; a resumed config may change them.
        for optimizer, section in ((self.actor_opt, self.cfg.actor), (self.critic_opt, self.cfg.critic)):
            for group in optimizer.param_groups:
                group["lr"] = section.lr
                group["weight_decay"] = self.cfg.training.weight_decay
        if self.run_dir is not None:
            truncate_logs(self.run_dir, state["logs"])
        self.last_checkpoint = self.guard.last_checkpoint = Path(ckpt)
        return self.iteration

    @property
    def stopped(self) -> bool:
        """True when the last ``train`` ended on a stop request rather than at its last iteration."""
        return self.stop.requested

    def train(self, iterations: Optional[int] = None) -> list[dict[str, Any]]:
        """Run until ``iterations`` (default ``ppo.iterations``) are done; checkpoint every N and at the end.

        A stop request (``self.stop``, set by SIGINT/SIGTERM in the stage) ends the loop at the next
        phase boundary with a checkpoint. A non-finite run raises ``NonFiniteError`` and writes no
        checkpoint, so the last good one stays the newest.
        """
        from tqdm.auto import tqdm

        total = iterations if iterations is not None else self.cfg.ppo.iterations
        bar = tqdm(total=total, initial=self.iteration, desc="PPO", unit="it",
                   disable=not self.cfg.logging.progress, dynamic_ncols=True)
        try:
            while self.iteration < total and not self.stop.requested:
                row = self.step()
                if row is None:
                    break
                bar.update(1)
                bar.set_postfix(progress_postfix(row))
                # Not while non-finite steps are in a row: that state (e.g. a NaN-fed score
                # normaliser) is not one to resume from; the last good checkpoint stays the newest.
                healthy = self.guard.in_row == 0
                if healthy and (self.iteration % self.cfg.checkpoint.every == 0 or self.iteration == total):
                    self.checkpoint()
            saved = self.last_checkpoint is not None and self.last_checkpoint.name == checkpoint_name(self.iteration)
            if self.stop.requested and not saved and self.iteration > 0 and self.guard.in_row == 0:
                self.checkpoint()
        finally:
            bar.close()
            self.meter.close()
            if self.writer is not None:
                self.writer.close()
        return self.history

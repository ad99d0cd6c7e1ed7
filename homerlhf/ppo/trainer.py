"""The PPO loop: rollout -> scoring -> advantages -> K epochs of clipped updates -> metrics -> checkpoint.

``RLTrainer`` holds the state that lives across iterations (optimizers, KL controller, score
normaliser, data cursor) and its ``step`` calls the stages in order, each a function that can be
called and tested alone: :func:`homerlhf.ppo.collect.collect_experience` (rollout and scoring,
overlapped), :func:`homerlhf.ppo.advantages.compute_advantages`, :func:`homerlhf.ppo.update.ppo_update`
and :func:`homerlhf.ppo.metrics.iteration_metrics`; the math is ``homerlhf.ppo.math``'s, never re-derived here.

Backward and gradient clipping go through an ``accelerate.Accelerator`` (built for the card's
device), the one place a later multi-GPU launch would hook into; the policy's weights are placed
by its loader (``device_map``), not by the Accelerator. Under fp16 compute the update scales its
loss with a ``torch.amp.GradScaler`` of ours (``homerlhf.models.precision``), not accelerate's.
"""

from __future__ import annotations

import logging
import random
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import torch

from homerlhf.config.schema import RunConfig
from homerlhf.errors import UserError
from homerlhf.memory.peaks import PhaseMeter
from homerlhf.memory.planner import predicted_peaks
from homerlhf.memory.shapes import policy_shape
from homerlhf.models.policy import compute_dtype
from homerlhf.models.precision import loss_scaler, unmixed_accelerator
from homerlhf.ppo.advantages import (compute_advantages, compute_group_advantages, experience_kl_estimator,
                                     normalized_scores, sequence_kl)
from homerlhf.ppo.asynchronous import rollouts_ahead
from homerlhf.ppo.backends import ReferenceBackend, RewardBackend
from homerlhf.ppo.checkpoint import checkpoint_name, load_checkpoint, save_checkpoint
from homerlhf.ppo.collect import StageTimes, collect_experience, phase, rollout_state
from homerlhf.ppo.distributed import SINGLE, Ranks, check_data_parallel, gather_batch, global_mean
from homerlhf.ppo.engines import HFEngine, RolloutEngine
from homerlhf.ppo.experience import Experience
from homerlhf.ppo.guards import KLJump, NonFiniteGuard
from homerlhf.ppo.kl import build_kl_controller
from homerlhf.ppo.metrics import (KL_REF_START_WARN, MetricsWriter, iteration_metrics, kl_ref_start, progress_postfix,
                                   sample_records)
from homerlhf.ppo.resuming import truncate_logs
from homerlhf.ppo.reward_functions import RewardFunctionError, component_metrics
from homerlhf.ppo.rng import capture_rng_state, sample_seeds
from homerlhf.ppo.rollout import check_prompt_lengths
from homerlhf.ppo.running import RunningMoments
from homerlhf.ppo.stopping import StopRequested
from homerlhf.ppo.update import GroupLoss, UpdateState, build_optimizer, ppo_update

log = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# -- the loop ----------------------------------------------------------------------------------
class RLTrainer:
    """Holds cross-iteration state and runs ``iterations`` of PPO, GRPO or RLOO (``algorithm``).

    ``prompts``: tokenised prompts (lists of ids), sampled without replacement in a seeded order.
    ``rows``: each prompt's dataset row (indexed like ``prompts``), handed to the reward with it.
    ``run_dir``: where metrics, samples and checkpoints go (None: keep metrics in memory only).
    ``engine``: what samples the rollouts (default: the actor's own ``generate``), synced with the actor first.
    ``ranks``: data parallel over processes (:mod:`homerlhf.ppo.distributed`): this rank rolls out
    and trains on its slice of each global batch; rank 0 alone writes metrics and checkpoints.
    """

    def __init__(self, cfg: RunConfig, policy, reference: ReferenceBackend, reward: RewardBackend,
                 prompts: Sequence[Sequence[int]], run_dir: Optional[str | Path] = None, *, accelerator=None,
                 stop: Optional[StopRequested] = None, engine: Optional[RolloutEngine] = None,
                 rows: Optional[Sequence[dict]] = None, ranks: Ranks = SINGLE):

        if not prompts:
            raise UserError("no prompts to train on: check data.prompts")
        check_prompt_lengths(prompts, cfg.rollout.max_prompt_len)
        check_data_parallel(cfg.rollout.batch_size, cfg.ppo.group_size, ranks.world)
        self.ranks = ranks
        self.cfg = cfg
        self.policy = policy
        self.reference = reference
        self.reward = reward
        self.engine = engine if engine is not None else HFEngine(policy)
        self.prompts = [list(p) for p in prompts]
        if rows is not None and len(rows) != len(self.prompts):
            raise ValueError(f"{len(rows)} dataset rows for {len(self.prompts)} prompts")
        self.rows = list(rows) if rows is not None else None
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.accelerator = accelerator or unmixed_accelerator(cpu=cfg.card.device == "cpu")
        self.scaler = loss_scaler(compute_dtype(cfg.quant, cfg.card.device), policy.device)
        wd = cfg.training.weight_decay
        self.actor_opt = build_optimizer(cfg.actor.optimizer, policy.actor_parameters(), cfg.actor.lr, wd)
        self.critic_opt = (build_optimizer(cfg.critic.optimizer, policy.critic_parameters(), cfg.critic.lr, wd)
                           if cfg.has_critic else None)  # GRPO / RLOO: no critic
        self.kl_ctl = build_kl_controller(cfg.ppo)
        self.score_moments = RunningMoments()
        self.generator = torch.Generator().manual_seed(cfg.seed)  # mini-batch shuffles
        self.iteration = 0
        self.data_epoch = 0
        self.data_cursor = 0
        self.update_state = UpdateState(cfg.ppo.micro_batch_size)
        self.shape = policy_shape(policy, cfg.model.name_or_path)
        self.rollout_state = rollout_state(cfg, self.shape)  # an auto generation chunk planned for this card
        self.guard = NonFiniteGuard(cfg.training.max_nonfinite_steps)
        self.kl_jump = KLJump(cfg, warn=ranks.is_main)  # flags an update that leaves the reference
        # The stage installs the signal handlers; a bare trainer only stops when asked in code.
        self.stop = stop if stop is not None else StopRequested()
        self.last_checkpoint: Optional[Path] = None
        self._iteration_start: Optional[tuple[dict[str, Any], dict[str, Any]]] = None
        self._dropped_iteration = False
        self.history: list[dict[str, Any]] = []
        self.writer = MetricsWriter(self.run_dir, cfg) if self.run_dir and ranks.is_main else None  # rank 0 logs
        self.meter = PhaseMeter(policy.device)
        self.total_iterations = cfg.ppo.iterations  # what train() runs to: the last samples nothing ahead
        self.ahead = rollouts_ahead(cfg, ranks, self.engine, reference, reward, self.rollout_state, self.prompts,
                                    self.rows, self.run_dir, policy)  # async: the batch sampled ahead, else None

    # Prompts come from a seeded permutation per pass over the data: (data_epoch, data_cursor)
    # pins the position, which is all a resume needs.
    def next_indices(self) -> list[int]:
        """Indices into ``prompts`` (and ``rows``) of the next ``rollout.batch_size`` samples:
        ``batch_size / ppo.group_size`` distinct prompts, each repeated ``group_size`` times in a row
        (one group per prompt)."""
        group = self.cfg.ppo.group_size
        wanted = self.cfg.rollout.batch_size // group
        batch: list[int] = []
        while len(batch) < wanted:
            order = torch.randperm(len(self.prompts), device="cpu", generator=torch.Generator().manual_seed(
                self.cfg.seed * 1_000_003 + self.data_epoch))
            take = order[self.data_cursor : self.data_cursor + wanted - len(batch)]
            batch.extend(take.tolist())
            self.data_cursor += len(take)
            if self.data_cursor >= len(self.prompts):
                self.data_epoch, self.data_cursor = self.data_epoch + 1, 0
        return [index for index in batch for _ in range(group)]

    def next_prompts(self) -> list[list[int]]:
        return [self.prompts[i] for i in self.next_indices()]

    def state_dict(self) -> dict[str, Any]:
        return {
            "iteration": self.iteration,
            "kl_controller": self.kl_ctl.state_dict(),
            "score_moments": self.score_moments.state_dict(),
            "data_epoch": self.data_epoch,
            "data_cursor": self.data_cursor,
            "micro_batch_size": self.update_state.micro_batch_size,
            "rollout_chunk_size": self.rollout_state.chunk_size,
            "rollout_generation_chunk": self.rollout_state.generation_chunk,
            "kl_previous": self.kl_jump.previous_kl,  # the KL-jump flag's last kl_mean: exact after a resume
        }

    def _generators(self) -> dict[str, torch.Generator]:
        return {"minibatch": self.generator}

    def _optimizers(self) -> dict[str, Any]:
        return {name: opt for name, opt in (("actor", self.actor_opt), ("critic", self.critic_opt)) if opt is not None}

    def _stateful(self) -> dict[str, Any]:
        stateful = {"kl_controller": self.kl_ctl, "score_moments": self.score_moments, "nonfinite_guard": self.guard}
        if self.scaler.is_enabled():  # fp16 compute: the loss scale resumes where it was
            stateful["grad_scaler"] = self.scaler
        return stateful

    def _drop_iteration(self) -> None:
        _, counters = self._iteration_start
        self.iteration = counters["iteration"]
        self.data_epoch = counters["data_epoch"]
        self.data_cursor = counters["data_cursor"]
        self._dropped_iteration = True
        if self.ahead is not None:
            self.ahead.drop_iteration()

    def step(self) -> Optional[dict[str, Any]]:
        """One iteration: rollout and scoring, advantages, update, metrics. Returns the metrics row,
        or None when a stop request arrived during rollout/scoring (the iteration is then dropped)."""
        # Everything a checkpoint of "before this iteration" needs, should a stop drop the rest of it.
        self._iteration_start = (capture_rng_state(self._generators()), self.state_dict())
        self.iteration += 1
        self.meter.reset()
        times = StageTimes()
        started = time.perf_counter()
        redos_before = (self.rollout_state.oom_retries_generation, self.rollout_state.oom_retries_scoring)
        exp, entropy, components = (self._collect(times) if self.ahead is None else self.ahead.collect(
            self.iteration, self.next_indices, self.policy, self.total_iterations, self.meter, times))
        if self._stop_agreed():
            # Rollout over; nothing it made touched weights, optimizers or normaliser: dropping it is exact.
            self._drop_iteration()
            return None
        kl_coef = float(self.kl_ctl.value)
        exp, scores = self.advantages(exp, kl_coef, times)
        update = {**self.update(exp, times, kl_coef), "rollout_chunk_size": self.rollout_state.chunk_size,
                  "oom_retries_generation": self.rollout_state.oom_retries_generation - redos_before[0],
                  "oom_retries_scoring": self.rollout_state.oom_retries_scoring - redos_before[1]}
        kl_mean = global_mean(sequence_kl(exp), self._reduce) if self._reduce else float(sequence_kl(exp).mean())
        self.kl_ctl.update(kl_mean, len(exp) * self.ranks.world)
        # The metrics row and the samples are of the whole global batch (every rank's, in rank order).
        exp, scores, entropy, components = gather_batch(self.ranks, exp, scores, entropy, components,
                                                        self.policy.tokenizer.pad_token_id)
        row = iteration_metrics(self.iteration, exp, scores, entropy, kl_coef, update, times,
                                mini_batch_size=self.cfg.ppo.mini_batch_size, started=started,
                                group_size=self.cfg.ppo.group_size if not self.cfg.has_critic else None,
                                kl_estimator=experience_kl_estimator(self.cfg))
        if self.iteration == 1:
            row["kl_ref_start"] = self._kl_ref_start(exp)
        row.update(component_metrics(components))
        row.update(self.kl_jump.check(row))
        row.update(self.memory_metrics())
        self.record(row, exp)
        return row

    def _collect(self, times: StageTimes) -> tuple[Experience, torch.Tensor, dict[str, list]]:
        """Rollout and scoring by the engine synced to the actor: experience, entropy (B, T), per-reward scores."""
        t0 = time.perf_counter()
        self.engine.sync(self.policy)  # the engine's own copy of the actor, if it keeps one
        times.generation += time.perf_counter() - t0
        indices = self.next_indices()
        seeds = sample_seeds(self.cfg.seed, self.iteration, len(indices))
        lo, hi = self.ranks.shard(len(indices))  # this rank's slice of the global batch
        indices, seeds = indices[lo:hi], seeds[lo:hi]
        rows = [self.rows[i] for i in indices] if self.rows is not None else None
        exp, entropy = collect_experience(
            self.policy, [self.prompts[i] for i in indices], self.cfg, self.reference, self.reward, engine=self.engine,
            rows=rows, meter=self.meter, times=times, seeds=seeds, state=self.rollout_state)
        version = torch.full((len(exp),), self.iteration - 1, dtype=torch.long, device=exp.device)
        return replace(exp, policy_version=version), entropy, self.reward.take_component_scores()

    @property
    def _reduce(self):
        """Sum over the data-parallel ranks; None with one process (the one-process math as it was)."""
        return self.ranks.sum if self.ranks.distributed else None

    def _stop_agreed(self) -> bool:
        """A stop request on any rank stops every rank at the same phase boundary."""
        if self.ranks.distributed and self.ranks.any(self.stop.requested) and not self.stop.requested:
            self.stop.request("stop requested on another rank")
        return self.stop.requested

    @staticmethod
    def _kl_ref_start(exp: Experience) -> float:
        """The reference's distance from the actor before any update, warned about when not ~0."""
        kl = kl_ref_start(exp)
        if kl > KL_REF_START_WARN:
            log.warning("kl_ref_start = %.2e nats/token (> %.0e): the reference is not the actor's starting "
                        "model; export it from the policy base (ref.from_nf4) or expect a KL penalty from step 0",
                        kl, KL_REF_START_WARN)
        return kl

    def advantages(self, exp: Experience, kl_coef: float, times: StageTimes) -> tuple[Experience, torch.Tensor]:
        """Scores as they enter the rewards (B,), then rewards, GAE and whitening on ``exp``."""
        t0 = time.perf_counter()
        scores = normalized_scores(exp.scores, self.cfg.ppo, self.score_moments, self._reduce)
        if self.cfg.has_critic:
            exp = compute_advantages(exp, self.cfg.ppo, kl_coef, scores, self._reduce)
        else:
            exp = compute_group_advantages(exp, self.cfg, kl_coef, scores)
        times.advantages = time.perf_counter() - t0
        return exp, scores

    def update(self, exp: Experience, times: StageTimes, kl_coef: float) -> dict[str, float]:
        """The PPO epochs over ``exp`` (the update phase): their stats averaged over optimizer steps,
        the micro-batch size in use and this iteration's OOM retries."""
        t0 = time.perf_counter()
        retries_before = self.update_state.oom_retries
        group = None if self.cfg.has_critic else GroupLoss.from_config(self.cfg, kl_coef)
        with phase(self.meter, "update"):
            update = ppo_update(self.policy, exp, self.cfg, self.actor_opt, self.critic_opt, self.accelerator,
                                self.generator, self.update_state, self.guard, self.scaler, group, self.ranks)
        times.update = time.perf_counter() - t0
        return {**update, "micro_batch_size": self.update_state.micro_batch_size,
                "oom_retries": self.update_state.oom_retries - retries_before}

    def memory_metrics(self) -> dict[str, Any]:
        """Measured peak GiB per phase, the planner's prediction beside them, and what was measured."""
        row: dict[str, Any] = {f"peak_mem_{name}_gib": gib for name, gib in self.meter.peaks().items()}
        if self.shape is not None:
            cfg = self.cfg
            if self.update_state.micro_batch_size != cfg.ppo.micro_batch_size:  # after an OOM backoff
                cfg = cfg.model_copy(update={"ppo": cfg.ppo.model_copy(
                    update={"micro_batch_size": self.update_state.micro_batch_size})})
            for name, gib in predicted_peaks(cfg, self.shape).items():
                row[f"predicted_mem_{name}_gib"] = gib
        row["peak_mem_kind"] = self.meter.kind
        return row

    def record(self, row: dict[str, Any], exp: Experience) -> None:
        """Keep the row; write it and the iteration's samples to the run dir and the trackers."""
        self.history.append(row)
        if self.writer is not None:
            self.writer.log(row, sample_records(exp, self.policy.tokenizer, self.cfg.logging.samples_per_iteration))

    def checkpoint(self) -> Optional[Path]:
        """Write the full checkpoint of the state after ``self.iteration`` (see ``homerlhf.ppo.checkpoint``)."""
        if self.run_dir is None:
            return None
        rng_state = self._iteration_start[0] if self._dropped_iteration else None
        write_extra = self.ahead.checkpoint_files() if self.ahead is not None else None  # the batch ahead
        self.ranks.barrier()  # every rank has finished the iteration; their weights are the same
        path = None
        if self.ranks.is_main:
            path = save_checkpoint(
                self.run_dir, self.iteration, policy=self.policy, optimizers=self._optimizers(), config=self.cfg,
                trainer_state=self.state_dict(), stateful=self._stateful(), rng_state=rng_state,
                generators=self._generators(), keep=self.cfg.checkpoint.keep, write_extra=write_extra,
            )
        path = self.ranks.broadcast(path)  # and a barrier: no rank goes on before the checkpoint is whole
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
        self.rollout_state.chunk_size = int(counters.get("rollout_chunk_size", self.rollout_state.chunk_size))
        self.rollout_state.generation_chunk = counters.get("rollout_generation_chunk")  # None before there was one
        self.kl_jump.previous_kl = counters.get("kl_previous")  # None in a checkpoint of before the flag
        # load_state_dict brings back the saved learning rates; a resumed config may change them.
        for optimizer, section in ((self.actor_opt, self.cfg.actor), (self.critic_opt, self.cfg.critic)):
            for group in (optimizer.param_groups if optimizer is not None else []):
                group["lr"] = section.lr
                group["weight_decay"] = self.cfg.training.weight_decay
        if self.run_dir is not None and self.ranks.is_main:
            truncate_logs(self.run_dir, state["logs"])
        if self.ahead is not None:
            self.ahead.buffer.restore_from(Path(ckpt) / "buffer")
        self.last_checkpoint = self.guard.last_checkpoint = Path(ckpt)
        return self.iteration

    def _checkpoint_after_failed_rollout(self) -> str:
        """Drop the iteration whose rollout failed, checkpoint the last finished one; say where it is."""
        if self.ahead is not None:  # the failed batch was to be in the next checkpoint: the last one has its own
            self.ahead.discard()
            return (f"last checkpoint {self.last_checkpoint} (fix it, then --resume {self.run_dir})"
                    if self.last_checkpoint else "no checkpoint written (no good iteration finished)")
        self._drop_iteration()
        saved = self.last_checkpoint is not None and self.last_checkpoint.name == checkpoint_name(self.iteration)
        if self.iteration == 0 or self.run_dir is None or self.guard.in_row:
            return "no checkpoint written (no good iteration finished)"
        path = self.last_checkpoint if saved else self.checkpoint()
        return f"stopped after iteration {self.iteration}, checkpoint {path} (fix it, then --resume {self.run_dir})"

    @property
    def stopped(self) -> bool:
        """True when the last ``train`` ended on a stop request rather than at its last iteration."""
        return self.stop.requested

    def train(self, iterations: Optional[int] = None) -> list[dict[str, Any]]:
        """Run until ``iterations`` (default ``ppo.iterations``) are done; checkpoint every N and at the end.

        A stop request (``self.stop``, set by SIGINT/SIGTERM in the stage) ends the loop at the next
        phase boundary with a checkpoint. A non-finite run raises ``NonFiniteError`` and writes no
        checkpoint, so the last good one stays the newest. A reward function that fails on a sample
        (``RewardFunctionError``) drops the iteration in flight, checkpoints the last finished one
        and raises with where that checkpoint is.
        """
        from tqdm.auto import tqdm

        total = iterations if iterations is not None else self.cfg.ppo.iterations
        self.total_iterations = total
        bar = tqdm(total=total, initial=self.iteration, desc=self.cfg.algorithm.upper(), unit="it",
                   disable=not (self.cfg.logging.progress and self.ranks.is_main), dynamic_ncols=True)
        try:
            while self.iteration < total and not self._stop_agreed():
                try:
                    row = self.step()
                    if row is None:
                        break
                    bar.update(1)
                    bar.set_postfix(progress_postfix(row))
                    # Not while non-finite steps are in a row: that state (e.g. a NaN-fed score
                    # normaliser) is not one to resume from; the last good checkpoint stays the newest.
                    healthy = self.guard.in_row == 0
                    if healthy and (self.iteration % self.cfg.checkpoint.every == 0 or self.iteration == total):
                        self.checkpoint()  # async: waits for the batch ahead, a failure of its surfaces here
                except RewardFunctionError as exc:
                    raise RewardFunctionError(f"{exc}; {self._checkpoint_after_failed_rollout()}") from None
            saved = self.last_checkpoint is not None and self.last_checkpoint.name == checkpoint_name(self.iteration)
            if self.stop.requested and not saved and self.iteration > 0 and self.guard.in_row == 0:
                self.checkpoint()
        finally:
            bar.close()
            if self.ahead is not None:
                self.ahead.close()
            self.meter.close()
            if self.writer is not None:
                self.writer.close()
        return self.history


def __getattr__(name: str):
    if name == "PPOTrainer":  # the old name, still importable
        warnings.warn("homerlhf.ppo.trainer.PPOTrainer is now RLTrainer", FutureWarning, stacklevel=2)
        return RLTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

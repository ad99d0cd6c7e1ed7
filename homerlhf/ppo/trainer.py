"""The run around the RL iteration: what lives across iterations, the loop over them, the metrics
row, checkpoints, resume and stop requests.

:func:`homerlhf.ppo.loop.iteration` is the algorithm (read it first); :class:`RLTrainer` is the ``run``
it is given: the rollout source (:mod:`.collect`, or :mod:`.asynchronous` with ``rollout.async``), the
update's optimizers and guards (:class:`homerlhf.ppo.update.Updater`), the KL controller, the score
normaliser, the data cursor, the meters and the metrics writer. Checkpoints: :mod:`.checkpoint`.
"""

from __future__ import annotations

import logging
import random
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from homerlhf.config.schema import RunConfig
from homerlhf.errors import UserError
from homerlhf.memory.peaks import PhaseMeter
from homerlhf.memory.planner import predicted_peaks
from homerlhf.memory.shapes import policy_shape
from homerlhf.ppo.asynchronous import RolloutsAhead
from homerlhf.ppo.backends import Backends
from homerlhf.ppo.checkpoint import RunState, checkpoint_name, load_checkpoint, save_checkpoint
from homerlhf.ppo.collect import Prompts, SyncRollouts, rollout_state
from homerlhf.ppo.distributed import SINGLE, Ranks, gather_batch
from homerlhf.ppo.engines import HFEngine
from homerlhf.ppo.experience import Experience, Rollout
from homerlhf.ppo.guards import KLJump, NoOpGuards, weights_fingerprint
from homerlhf.ppo.kl import build_kl_controller
from homerlhf.ppo.loop import iteration
from homerlhf.ppo.meters import Meters
from homerlhf.ppo.metrics import (KL_REF_START_WARN, MetricsWriter, iteration_metrics, kl_ref_start, progress_postfix,
                                   sample_records, signal_inputs)
from homerlhf.ppo.resuming import truncate_logs
from homerlhf.ppo.reward_functions import RewardFunctionError, component_metrics
from homerlhf.ppo.rng import capture_rng_state
from homerlhf.ppo.rollout import check_prompt_lengths
from homerlhf.ppo.running import RunningMoments
from homerlhf.ppo.signals import SignalMonitor
from homerlhf.ppo.stopping import StopRequested
from homerlhf.ppo.update import Updater

log = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class RLTrainer:
    """Holds what lives across iterations and runs ``iterations`` of PPO, GRPO or RLOO (``algorithm``).

    ``backends``: the reference, the reward and the rollout engine (default: the actor's own
    ``generate``), synced with the actor before each rollout. ``prompts``: tokenised prompts (lists of
    ids), sampled without replacement in a seeded order; ``rows``: each one's dataset row (indexed
    alike), handed to the reward with it. ``run_dir``: where metrics, samples and checkpoints go (None:
    metrics in memory only). ``ranks``: data parallel (:mod:`homerlhf.ppo.distributed`): this rank
    rolls out and trains on its slice of each global batch; rank 0 alone writes. ``stop``: a
    :class:`StopRequested` the stage's signal handlers set; a bare trainer stops only when asked in code.
    """

    def __init__(self, cfg: RunConfig, policy, backends: Backends, prompts: Sequence[Sequence[int]],
                 run_dir: Optional[str | Path] = None, *, rows: Optional[Sequence[dict]] = None, ranks: Ranks = SINGLE):
        if not prompts:
            raise UserError("no prompts to train on: check data.prompts")
        check_prompt_lengths(prompts, cfg.rollout.max_prompt_len)
        self.cfg, self.policy, self.ranks = cfg, policy, ranks
        self.backends = backends if backends.engine is not None else replace(backends, engine=HFEngine(policy))
        self.prompts = Prompts([list(p) for p in prompts], list(rows) if rows is not None else None)
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.updater = Updater.for_run(cfg, policy, ranks)  # optimizers, scaler, guard, mini-batch generator
        self.kl_controller = build_kl_controller(cfg.ppo)
        self.score_moments = RunningMoments()
        self.iteration = self.data_epoch = self.data_cursor = 0
        self.shape = policy_shape(policy, cfg.model.name_or_path)
        self.rollout_state = rollout_state(cfg, self.shape)  # an auto generation chunk planned for this card
        self.kl_jump = KLJump(cfg, warn=ranks.is_main)  # flags an update that leaves the reference
        self.signals = SignalMonitor(cfg, warn=ranks.is_main)  # the reward-hacking signals and their flags
        self.noop = NoOpGuards(cfg, warn=ranks.is_main)  # stops a run that trains nothing
        self._weights_before: Optional[torch.Tensor] = None
        self.stop = StopRequested()
        self.last_checkpoint: Optional[Path] = None
        self._iteration_start: Optional[tuple[dict[str, Any], dict[str, Any]]] = None
        self._redos_at_start = (0, 0, 0)
        self._dropped_iteration = False
        self.history: list[dict[str, Any]] = []
        self.writer = MetricsWriter(self.run_dir, cfg) if self.run_dir and ranks.is_main else None  # rank 0 logs
        self.meters = Meters(PhaseMeter(policy.device))
        self.total_iterations = cfg.ppo.iterations  # what train() runs to: the last samples nothing ahead
        self.rollouts = self._rollout_source()

    def _rollout_source(self) -> SyncRollouts | RolloutsAhead:
        """``rollout.async`` samples a batch ahead (one process: :func:`homerlhf.stages.data_parallel.check_processes`)."""
        parts = (self.policy, self.cfg, self.backends, self.prompts, self.rollout_state, self.meters)
        if self.cfg.rollout.async_:
            return RolloutsAhead(*parts, self.run_dir)
        return SyncRollouts(*parts, self.ranks)

    # Prompts come from a seeded permutation per pass over the data: (data_epoch, data_cursor)
    # pins the position, which is all a resume needs.
    def next_indices(self) -> list[int]:
        """Indices into ``prompts`` (and ``rows``) of the next ``rollout.batch_size`` samples:
        ``batch_size / group.size`` distinct prompts, each repeated ``group.size`` times in a row
        (one group per prompt)."""
        group = self.cfg.group.size
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
        return [self.prompts.ids[i] for i in self.next_indices()]

    @property
    def reduce(self):
        """Sum over the data-parallel ranks; None with one process (the one-process math as it was)."""
        return self.ranks.sum if self.ranks.distributed else None

    # -- around each iteration -------------------------------------------------------------------
    def step(self) -> Optional[dict[str, Any]]:
        """One iteration (:func:`homerlhf.ppo.loop.iteration`). Returns the metrics row, or None when a
        stop request arrived during rollout/scoring (the iteration is then dropped)."""
        # Everything a checkpoint of "before this iteration" needs, should a stop drop the rest of it.
        self._iteration_start = (capture_rng_state(self._generators()), self.state_dict())
        self._redos_at_start = self._redos()
        self.iteration += 1
        self.meters.reset()
        if self.cfg.guards.lora_unchanged:  # the actor's weights before the update, for the no-op guard
            self._weights_before = weights_fingerprint(self.policy.actor_parameters())
        row = iteration(self)
        if row is None:
            self._drop_iteration()
        return row

    def stop_agreed(self) -> bool:
        """A stop request on any rank stops every rank at the same phase boundary."""
        if self.ranks.distributed and self.ranks.any(self.stop.requested) and not self.stop.requested:
            self.stop.request("stop requested on another rank")
        return self.stop.requested

    def log(self, rollout: Rollout, exp: Experience, scores: torch.Tensor, kl_coef: float,
            update: dict[str, float]) -> dict[str, Any]:
        """The iteration's metrics row, of the whole global batch (every rank's, in rank order), with
        what wraps the loop (OOM redos, memory peaks, the KL-jump flag); written with its samples.
        ``exp``: the rollout's experience with its advantages."""
        exp, scores, entropy, components = gather_batch(self.ranks, exp, scores, rollout.entropy, rollout.components,
                                                        self.policy.tokenizer.pad_token_id)
        row = iteration_metrics(self.iteration, Rollout(exp, entropy), scores, kl_coef,
                                {**update, **self._redo_metrics()}, self.meters, self.cfg)
        if self.iteration == 1:
            row["kl_ref_start"] = self._kl_ref_start(exp)
        row.update(component_metrics(components))
        row.update(self.kl_jump.check(row))
        row.update(self.signals.check(self.iteration, row, *signal_inputs(exp), components))
        row.update(self.memory_metrics())
        self.record(row, exp)
        after = weights_fingerprint(self.policy.actor_parameters()) if self._weights_before is not None else None
        self.noop.check(row, exp, self._weights_before, after)  # after the row is written: the audit sees it
        return row

    def _redos(self) -> tuple[int, int, int]:
        state = self.rollout_state
        return self.updater.state.oom_retries, state.oom_retries_generation, state.oom_retries_scoring

    def _redo_metrics(self) -> dict[str, int]:
        """The micro-batch and rollout chunk in use, and this iteration's OOM redos in each phase."""
        update, generation, scoring = (now - then for now, then in zip(self._redos(), self._redos_at_start))
        return {"micro_batch_size": self.updater.state.micro_batch_size, "oom_retries": update,
                "rollout_chunk_size": self.rollout_state.chunk_size, "oom_retries_generation": generation,
                "oom_retries_scoring": scoring}

    @staticmethod
    def _kl_ref_start(exp: Experience) -> float:
        """The reference's distance from the actor before any update, warned about when not ~0."""
        kl = kl_ref_start(exp)
        if kl > KL_REF_START_WARN:
            log.warning("kl_ref_start = %.2e nats/token (> %.0e): the reference is not the actor's starting "
                        "model; export it from the policy base (ref.from_nf4) or expect a KL penalty from step 0",
                        kl, KL_REF_START_WARN)
        return kl

    def memory_metrics(self) -> dict[str, Any]:
        """Measured peak GiB per phase, the planner's prediction beside them, and what was measured."""
        meter = self.meters.memory
        row: dict[str, Any] = {f"peak_mem_{name}_gib": gib for name, gib in meter.peaks().items()}
        if self.shape is not None:
            cfg, micro = self.cfg, self.updater.state.micro_batch_size
            if micro != cfg.ppo.micro_batch_size:  # after an OOM backoff
                cfg = cfg.model_copy(update={"ppo": cfg.ppo.model_copy(update={"micro_batch_size": micro})})
            for name, gib in predicted_peaks(cfg, self.shape).items():
                row[f"predicted_mem_{name}_gib"] = gib
        row["peak_mem_kind"] = meter.kind
        return row

    def record(self, row: dict[str, Any], exp: Experience) -> None:
        """Keep the row; write it and the iteration's samples to the run dir and the trackers."""
        self.history.append(row)
        if self.writer is not None:
            logging_cfg = self.cfg.logging
            self.writer.log(row, sample_records(exp, self.policy.tokenizer, logging_cfg.samples_per_iteration,
                                                logging_cfg.samples_top_bottom))

    # -- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "iteration": self.iteration,
            "kl_controller": self.kl_controller.state_dict(),
            "score_moments": self.score_moments.state_dict(),
            "data_epoch": self.data_epoch,
            "data_cursor": self.data_cursor,
            "micro_batch_size": self.updater.state.micro_batch_size,
            "rollout_chunk_size": self.rollout_state.chunk_size,
            "rollout_generation_chunk": self.rollout_state.generation_chunk,
            "kl_previous": self.kl_jump.previous_kl,  # the KL-jump flag's last kl_mean: exact after a resume
            "signals": self.signals.state_dict(),  # the signals' baselines and flag counts
            "noop_guards": self.noop.state_dict(),
        }

    def _generators(self) -> dict[str, torch.Generator]:
        return {"minibatch": self.updater.generator}

    def _optimizers(self) -> dict[str, Any]:
        return {name: opt for name, opt in (("actor", self.updater.actor_opt), ("critic", self.updater.critic_opt))
                if opt is not None}

    def _stateful(self) -> dict[str, Any]:
        stateful = {"kl_controller": self.kl_controller, "score_moments": self.score_moments,
                    "nonfinite_guard": self.updater.guard}
        if self.updater.scaler.is_enabled():  # fp16 compute: the loss scale resumes where it was
            stateful["grad_scaler"] = self.updater.scaler
        return stateful

    def _run_state(self) -> RunState:
        return RunState(self.policy, self._optimizers(), self._stateful(), self._generators(), self.state_dict())

    def _drop_iteration(self) -> None:
        _, counters = self._iteration_start
        self.iteration = counters["iteration"]
        self.data_epoch = counters["data_epoch"]
        self.data_cursor = counters["data_cursor"]
        self._dropped_iteration = True
        self.rollouts.drop_iteration()

    def checkpoint(self) -> Optional[Path]:
        """Write the full checkpoint of the state after ``self.iteration`` (see ``homerlhf.ppo.checkpoint``)."""
        if self.run_dir is None:
            return None
        rng_state = self._iteration_start[0] if self._dropped_iteration else None
        write_extra = self.rollouts.checkpoint_files()  # the batch sampled ahead, if any
        self.ranks.barrier()  # every rank has finished the iteration; their weights are the same
        path = None
        if self.ranks.is_main:
            path = save_checkpoint(self.run_dir, self.iteration, self._run_state(), self.cfg, rng_state=rng_state,
                                   keep=self.cfg.checkpoint.keep, write_extra=write_extra)
        path = self.ranks.broadcast(path)  # and a barrier: no rank goes on before the checkpoint is whole
        self.last_checkpoint = self.updater.guard.last_checkpoint = path
        return path

    def resume(self, ckpt: str | Path) -> int:
        """Continue from a checkpoint: weights, optimizers, controllers, RNG, data cursor; the run's
        logs are cut back to what they held at that checkpoint. Returns the iteration reached."""
        state = load_checkpoint(ckpt, self._run_state())
        counters, micro = state["trainer"], self.updater.state
        self.iteration = int(state["iteration"])
        self.data_epoch = int(counters["data_epoch"])
        self.data_cursor = int(counters["data_cursor"])
        micro.micro_batch_size = int(counters.get("micro_batch_size", micro.micro_batch_size))
        self.rollout_state.chunk_size = int(counters.get("rollout_chunk_size", self.rollout_state.chunk_size))
        self.rollout_state.generation_chunk = counters.get("rollout_generation_chunk")  # None: one chunk for both
        self.kl_jump.previous_kl = counters.get("kl_previous")  # None in a checkpoint without the flag
        self.signals.load_state_dict(counters.get("signals"))  # None in a checkpoint from before the signals
        self.noop.load_state_dict(counters.get("noop_guards"))
        # load_state_dict brings back the saved learning rates; a resumed config may change them.
        for optimizer, section in ((self.updater.actor_opt, self.cfg.actor), (self.updater.critic_opt, self.cfg.critic)):
            for group in (optimizer.param_groups if optimizer is not None else []):
                group["lr"] = section.lr
                group["weight_decay"] = self.cfg.training.weight_decay
        if self.run_dir is not None and self.ranks.is_main:
            truncate_logs(self.run_dir, state["logs"])
        self.rollouts.restore_from(Path(ckpt))
        self.last_checkpoint = self.updater.guard.last_checkpoint = Path(ckpt)
        return self.iteration

    def _checkpoint_after_failed_rollout(self) -> str:
        """Drop the iteration whose rollout failed, checkpoint the last finished one; say where it is."""
        if self.rollouts.samples_ahead:  # the failed batch was to be in the next checkpoint: the last one has its own
            self.rollouts.discard()
            return (f"last checkpoint {self.last_checkpoint} (fix it, then --resume {self.run_dir})"
                    if self.last_checkpoint else "no checkpoint written (no good iteration finished)")
        self._drop_iteration()
        saved = self.last_checkpoint is not None and self.last_checkpoint.name == checkpoint_name(self.iteration)
        if self.iteration == 0 or self.run_dir is None or self.updater.guard.in_row:
            return "no checkpoint written (no good iteration finished)"
        path = self.last_checkpoint if saved else self.checkpoint()
        return f"stopped after iteration {self.iteration}, checkpoint {path} (fix it, then --resume {self.run_dir})"

    # -- the loop over iterations ----------------------------------------------------------------
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
        total = iterations if iterations is not None else self.cfg.ppo.iterations
        self.total_iterations = total
        bar = tqdm(total=total, initial=self.iteration, desc=self.cfg.algorithm.upper(), unit="it",
                   disable=not (self.cfg.logging.progress and self.ranks.is_main), dynamic_ncols=True)
        guard = self.updater.guard
        try:
            while self.iteration < total and not self.stop_agreed():
                try:
                    row = self.step()
                    if row is None:
                        break
                    bar.update(1)
                    bar.set_postfix(progress_postfix(row))
                    # Not while non-finite steps are in a row: that state (e.g. a NaN-fed score
                    # normaliser) is not one to resume from; the last good checkpoint stays the newest.
                    if guard.in_row == 0 and (self.iteration % self.cfg.checkpoint.every == 0 or self.iteration == total):
                        self.checkpoint()  # async: waits for the batch ahead, a failure of its surfaces here
                except RewardFunctionError as exc:
                    raise RewardFunctionError(f"{exc}; {self._checkpoint_after_failed_rollout()}") from None
            saved = self.last_checkpoint is not None and self.last_checkpoint.name == checkpoint_name(self.iteration)
            if self.stop.requested and not saved and self.iteration > 0 and guard.in_row == 0:
                self.checkpoint()
        finally:
            bar.close()
            self.rollouts.close()
            self.meters.memory.close()
            if self.writer is not None:
                self.writer.close()
        return self.history


def __getattr__(name: str):
    if name == "PPOTrainer":  # the old name, still importable
        warnings.warn("homerlhf.ppo.trainer.PPOTrainer is now RLTrainer", FutureWarning, stacklevel=2)
        return RLTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

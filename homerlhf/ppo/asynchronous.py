"""The asynchronous mode (``rollout.async``): the next iteration's batch is generated while this one updates.

With the policy version ``v`` = updates applied so far (``k - 1`` when iteration ``k`` starts),
iteration ``k`` runs:

1. take batch ``k`` from the buffer: sampled during iteration ``k - 1``'s update by the engine
   holding adapter version ``k - 2`` (lag 1). Iteration 1, with nothing ahead, samples its own
   batch first (lag 0);
2. sync the engine to version ``k - 1`` and start batch ``k + 1`` in a background thread: engine
   sampling, then reference log-probs and reward scores (a reference on the policy's own modules,
   ``adapter_off``, cannot run beside the update: the trainer takes those when it takes the batch);
3. meanwhile the trainer computes batch ``k``'s old log-probs and values with its own module
   (version ``k - 1``), advantages, and the update that makes version ``k``.

The PPO ratio uses the trainer's old log-probs; each token's loss is weighted by
``min(exp(old - behaviour), rollout.is_cap)`` (:mod:`homerlhf.ppo.importance`), which corrects
both the engine's other precision and the one update of staleness. The last iteration samples
nothing ahead. The batch ahead lives in an :class:`homerlhf.ppo.buffer.ExperienceBuffer` (on
disk in the run dir, part of every checkpoint).

The background thread and the trainer share the machine: on CPU both want every core (set
``rollout.engine_threads`` and the trainer's torch threads so they add up to the cores); the
overlap pays where the engine and the trainer run on different devices.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from homerlhf.config.schema import RunConfig
from homerlhf.errors import UserError
from homerlhf.ppo.backends import ReferenceBackend, RewardBackend
from homerlhf.ppo.buffer import ExperienceBuffer, PendingBatch
from homerlhf.ppo.collect import RolloutState, StageTimes, build_experience, generate_chunk, phase, score_in_chunks
from homerlhf.ppo.devices import to_trainer, worker_lists
from homerlhf.ppo.engines import RolloutEngine
from homerlhf.ppo.experience import Experience
from homerlhf.ppo.rng import sample_seeds
from homerlhf.ppo.rollout import RolloutBatch


def produce_batch(engine: RolloutEngine, reference: ReferenceBackend, reward: RewardBackend, cfg: RunConfig,
                  state: RolloutState, iteration: int, indices: Sequence[int], prompts: Sequence[Sequence[int]],
                  rows: Optional[Sequence[dict]], version: int, pad_id: int) -> PendingBatch:
    """Sample and score iteration ``iteration``'s batch (``prompts``, indexed by ``indices``) in the
    calling thread, chunk by chunk; the engine holds adapter ``version``. Each sample draws from its
    own seed (:func:`homerlhf.ppo.rng.sample_seeds`), so the batch does not depend on timing."""
    seeds = sample_seeds(cfg.seed, iteration, len(prompts))
    parts, futures, start = [], [], 0
    while start < len(prompts):
        batch = generate_chunk(engine, prompts[start:], seeds[start:], cfg, state)
        chunk_rows = rows[start : start + len(batch)] if rows is not None else None
        start += len(batch)
        prompt_lists, response_lists = worker_lists(batch)
        ref = None if reference.uses_policy else reference.submit_logprobs(prompt_lists, response_lists)
        futures.append((ref, reward.submit_score(prompt_lists, response_lists, chunk_rows)))
        parts.append(batch)
    batch = RolloutBatch.cat(parts, pad_id)
    device, width = batch.response_ids.device, batch.response_ids.shape[1]  # the engine's device
    ref_logprobs = None
    if not reference.uses_policy:
        ref_logprobs = torch.cat([to_trainer(ref.result(), device, width=width) for ref, _ in futures])
    scores = to_trainer([s for _, score in futures for s in score.result()], device)
    return PendingBatch(iteration, list(indices), batch,
                        torch.full((len(batch),), version, dtype=torch.long, device=device),
                        scores, ref_logprobs, reward.take_component_scores())


def pending_experience(policy, pending: PendingBatch, cfg: RunConfig, reference: ReferenceBackend,
                       state: RolloutState) -> tuple[Experience, Tensor]:
    """The experience of a batch from the buffer: the trainer's old log-probs, entropy and values
    (and the reference's, for one on the policy's modules) computed now. Returns it and the
    entropy (B, T)."""
    batch = to_trainer(pending.batch, policy.device)
    logprobs, entropy, values = score_in_chunks(policy, batch, state)
    ref_logprobs = pending.ref_logprobs
    if ref_logprobs is None:
        ref_logprobs = to_trainer(reference.logprobs(*worker_lists(batch)), logprobs.device,
                                  width=batch.response_ids.shape[1])
    exp = build_experience(batch, logprobs, values, ref_logprobs, pending.raw_scores, cfg,
                           shares_trainer_weights=False)
    return replace(exp, policy_version=to_trainer(pending.policy_version, exp.device)), entropy


class RolloutsAhead:
    """One batch sampled ahead in a background thread into the run's buffer (``RUN_DIR/buffer``,
    in memory without a run dir); see the module docstring. ``prompts`` and ``rows``: the trainer's,
    indexed by the indices it draws."""

    def __init__(self, engine: RolloutEngine, reference: ReferenceBackend, reward: RewardBackend, cfg: RunConfig,
                 state: RolloutState, prompts: Sequence[Sequence[int]], rows: Optional[Sequence[dict]],
                 run_dir: Optional[Path], policy):
        self.engine, self.reference, self.reward, self.cfg, self.state = engine, reference, reward, cfg, state
        self.prompts, self.rows = prompts, rows
        self.buffer = ExperienceBuffer(Path(run_dir) / "buffer" if run_dir is not None else None, policy.device)
        self.pad_id = policy.tokenizer.pad_token_id
        self._executor: Optional[ThreadPoolExecutor] = None
        self._future: Optional[Future] = None
        self._taken: Optional[PendingBatch] = None  # the batch of the iteration in progress, from the buffer

    def next_batch(self, iteration: int, draw: Callable[[], list[int]], policy, last_iteration: int) -> PendingBatch:
        """Iteration ``iteration``'s batch: taken from the buffer (waiting for it), or sampled now when
        there is none (iteration 1: lag 0). Between the two, the engine takes ``policy``'s adapter and,
        unless this is ``last_iteration``, starts sampling the next iteration's batch with it.
        ``draw()``: the next batch's prompt indices (the trainer's data cursor)."""
        version = iteration - 1  # updates applied so far
        self._taken = None
        self._taken = pending = self.take()
        self.engine.sync(policy)
        if pending is None:
            pending = self.produce(iteration, draw(), version)
        if pending.iteration != iteration:
            raise RuntimeError(f"the buffer holds iteration {pending.iteration}'s batch, not {iteration}'s")
        if iteration < last_iteration:
            self.start(iteration + 1, draw(), version)
        return pending

    def checkpoint_files(self) -> Callable[[Path], None]:
        """Waits for the batch in flight; returns what copies the buffer into a checkpoint being written."""
        self.settle()
        return lambda directory: self.buffer.copy_to(directory / "buffer")

    def collect(self, iteration: int, draw: Callable[[], list[int]], policy, last_iteration: int, meter,
                times: StageTimes) -> tuple[Experience, Tensor, dict[str, list]]:
        """The trainer's rollout and scoring stage in this mode: :meth:`next_batch`, then
        :func:`pending_experience`. Returns the experience, the entropy (B, T) and the per-reward scores."""
        t0 = time.perf_counter()
        with phase(meter, "generation"):
            pending = self.next_batch(iteration, draw, policy, last_iteration)
        t1 = time.perf_counter()
        times.generation += t1 - t0
        with phase(meter, "scoring"):
            exp, entropy = pending_experience(policy, pending, self.cfg, self.reference, self.state)
        times.scoring += time.perf_counter() - t1
        return exp, entropy, pending.components

    def drop_iteration(self) -> None:
        """The iteration in progress is dropped: the batch sampled ahead goes, the one it took is
        pending again (a batch it sampled for itself goes too: its prompts are drawn again)."""
        self.discard()
        if self._taken is not None:
            self.buffer.put(self._taken)

    def produce(self, iteration: int, indices: Sequence[int], version: int) -> PendingBatch:
        """:func:`produce_batch` of the prompts at ``indices``, in the calling thread."""
        rows = [self.rows[i] for i in indices] if self.rows is not None else None
        return produce_batch(self.engine, self.reference, self.reward, self.cfg, self.state, iteration, indices,
                             [self.prompts[i] for i in indices], rows, version, self.pad_id)

    def start(self, iteration: int, indices: Sequence[int], version: int) -> None:
        """Sample batch ``iteration`` in the background thread; it goes into the buffer when done."""
        self.settle()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="homerlhf-rollout-ahead")

        def run() -> None:
            self.buffer.put(self.produce(iteration, indices, version))

        self._future = self._executor.submit(run)

    @property
    def in_flight(self) -> bool:
        return self._future is not None

    def settle(self) -> None:
        """Wait for the batch in flight, if any; its error, if it failed, is raised here (once)."""
        future, self._future = self._future, None
        if future is not None:
            future.result()

    def take(self) -> Optional[PendingBatch]:
        """The batch ahead (waiting for it), removed from the buffer; None when there is none."""
        self.settle()
        return self.buffer.take()

    def discard(self) -> None:
        """Wait for the batch in flight and drop it, whatever happened to it."""
        self._wait_quietly()
        self.buffer.clear()

    def _wait_quietly(self) -> None:
        try:
            self.settle()
        except Exception:  # noqa: BLE001 - a batch being dropped: its failure no longer matters
            pass

    def close(self) -> None:
        """Let a batch in flight finish (into the buffer) and stop the thread."""
        self._wait_quietly()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


def rollouts_ahead(cfg: RunConfig, ranks, engine: RolloutEngine, reference: ReferenceBackend, reward: RewardBackend,
                   state: RolloutState, prompts, rows, run_dir: Optional[Path], policy) -> Optional[RolloutsAhead]:
    """The trainer's :class:`RolloutsAhead` in the asynchronous mode, None otherwise."""
    if not cfg.rollout.async_:
        return None
    if ranks.distributed:
        raise UserError("rollout.async runs in one process; drop it or launch without data parallelism")
    return RolloutsAhead(engine, reference, reward, cfg, state, prompts, rows, run_dir, policy)

"""The asynchronous mode (``rollout.async``): the next iteration's batch is generated while this one updates.

Iteration ``k`` takes batch ``k`` from the buffer (sampled during iteration ``k - 1``'s update by the
engine holding adapter version ``k - 2``; iteration 1 samples its own), syncs the engine to version
``k - 1`` and starts batch ``k + 1`` in a background thread (sampling, then the reference and reward
requests), while the trainer computes batch ``k``'s old log-probs and values and updates. The loss
weights each token by ``min(exp(old - behaviour), rollout.is_cap)`` (:mod:`homerlhf.ppo.importance`),
which corrects the one update of staleness. The batch ahead lives in an
:class:`homerlhf.ppo.buffer.ExperienceBuffer` (on disk in the run dir, in every checkpoint).
docs/ppo_details.md ("Asynchronous mode") has the details and measurements.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import Tensor

from homerlhf.config.schema import RunConfig
from homerlhf.ppo.backends import Backends, ReferenceBackend
from homerlhf.ppo.buffer import ExperienceBuffer, PendingBatch
from homerlhf.ppo.collect import Prompts, RolloutState, build_experience, generate_chunk, score_in_chunks
from homerlhf.ppo.devices import to_trainer, worker_lists
from homerlhf.ppo.experience import Experience, Rollout
from homerlhf.ppo.meters import Meters
from homerlhf.ppo.rng import sample_seeds
from homerlhf.ppo.rollout import RolloutBatch


def produce_batch(backends: Backends, cfg: RunConfig, state: RolloutState, iteration: int, prompts: Prompts,
                  version: int, pad_id: int) -> PendingBatch:
    """Sample and score iteration ``iteration``'s batch (``prompts``, taken from the run's) in the
    calling thread, chunk by chunk; the engine holds adapter ``version``. Each sample draws from its
    own seed (:func:`homerlhf.ppo.rng.sample_seeds`), so the batch does not depend on timing."""
    prompts = replace(prompts, seeds=sample_seeds(cfg.seed, iteration, len(prompts)))
    reference, reward = backends.reference, backends.reward
    parts, futures, start = [], [], 0
    while start < len(prompts):
        batch = generate_chunk(backends.engine, prompts.after(start), cfg, state)
        chunk_rows = prompts.rows[start : start + len(batch)] if prompts.rows is not None else None
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
    return PendingBatch(iteration, list(prompts.indices), batch,
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
    """The trainer's rollout source with ``rollout.async``: one batch sampled ahead in a background
    thread into the run's buffer (``RUN_DIR/buffer``, in memory without a run dir); see the module
    docstring. It has the methods of :class:`homerlhf.ppo.collect.SyncRollouts`."""

    samples_ahead = True

    def __init__(self, policy, cfg: RunConfig, backends: Backends, prompts: Prompts, state: RolloutState,
                 meters: Meters, run_dir: Optional[Path]):
        self.policy, self.cfg, self.backends, self.prompts, self.state = policy, cfg, backends, prompts, state
        self.meters = meters
        self.buffer = ExperienceBuffer(Path(run_dir) / "buffer" if run_dir is not None else None, policy.device)
        self.pad_id = policy.tokenizer.pad_token_id
        self._executor: Optional[ThreadPoolExecutor] = None
        self._future: Optional[Future] = None
        self._taken: Optional[PendingBatch] = None  # the batch of the iteration in progress, from the buffer

    def collect(self, iteration: int, draw: Callable[[], list[int]], last_iteration: int) -> Rollout:
        """Iteration ``iteration``'s rollout: :meth:`next_batch`, then :func:`pending_experience`."""
        with self.meters.stage("generation"):
            pending = self.next_batch(iteration, draw, last_iteration)
        with self.meters.stage("scoring"):
            exp, entropy = pending_experience(self.policy, pending, self.cfg, self.backends.reference, self.state)
        return Rollout(exp, entropy, pending.components)

    def next_batch(self, iteration: int, draw: Callable[[], list[int]], last_iteration: int) -> PendingBatch:
        """Iteration ``iteration``'s batch: taken from the buffer (waiting for it), or sampled now when
        there is none (iteration 1: lag 0). Between the two, the engine takes the policy's adapter and,
        unless this is ``last_iteration``, starts sampling the next iteration's batch with it.
        ``draw()``: the next batch's prompt indices (the trainer's data cursor)."""
        version = iteration - 1  # updates applied so far
        self._taken = None
        self._taken = pending = self.take()
        self.backends.engine.sync(self.policy)
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

    def restore_from(self, ckpt: Path) -> None:
        """The batch ahead saved in checkpoint ``ckpt``, back in the buffer (or none)."""
        self.buffer.restore_from(Path(ckpt) / "buffer")

    def drop_iteration(self) -> None:
        """The iteration in progress is dropped: the batch sampled ahead goes, the one it took is
        pending again (a batch it sampled for itself goes too: its prompts are drawn again)."""
        self.discard()
        if self._taken is not None:
            self.buffer.put(self._taken)

    def produce(self, iteration: int, indices: list[int], version: int) -> PendingBatch:
        """:func:`produce_batch` of the prompts at ``indices``, in the calling thread."""
        return produce_batch(self.backends, self.cfg, self.state, iteration, self.prompts.take(indices), version,
                             self.pad_id)

    def start(self, iteration: int, indices: list[int], version: int) -> None:
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

"""The two interfaces the trainer scores through: a reference model and a reward model.

Both take token ids (never text) as lists, one entry per sample, so the same calls work for an
in-process model and for a llama.cpp worker across HTTP. ``submit_*`` returns a future so the
trainer can overlap CPU scoring with GPU work; the base classes run the call in a worker thread.
The backends that compute import torch and the models in their methods: the interfaces load
without torch (1.7 s measured), for the workers layer above.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Sequence

from homerlhf.errors import UserError

if TYPE_CHECKING:
    from homerlhf.ppo.engines import RolloutEngine

TokenIds = Sequence[Sequence[int]]


class _Async:
    _executor: ThreadPoolExecutor | None = None

    def _submit(self, fn, *args) -> Future:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=type(self).__name__)
        return self._executor.submit(fn, *args)

    def close(self) -> None:
        """Release threads, processes and connections. Safe to call twice."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


class ReferenceBackend(_Async):
    """Per-token log-probs of each response under the reference model."""

    # True when it computes with the policy's own modules: then it may not run beside a policy
    # forward or update (the asynchronous mode scores with it in the trainer's thread).
    uses_policy: bool = False

    def logprobs(self, prompt_ids: TokenIds, response_ids: TokenIds) -> list[list[float]]:
        """Returns one list per sample with ``len(response_ids[i])`` floats:
        ``log p_ref(response[t] | prompt, response[:t])``."""
        raise NotImplementedError

    def submit_logprobs(self, prompt_ids: TokenIds, response_ids: TokenIds) -> "Future[list[list[float]]]":
        return self._submit(self.logprobs, prompt_ids, response_ids)


class RewardBackend(_Async):
    """One scalar score per (prompt, response).

    ``shares_policy``: it computes on the policy's own modules, so it must never run next to a
    policy forward: ``submit_score`` then scores in the caller's thread (a finished future).
    ``on_trainer_cpu``: an in-process model on the CPU, the cores the trainer computes on; a thread
    beside the trainer would only contend for them, so it scores in the caller's thread too.
    """

    shares_policy = False
    on_trainer_cpu = False

    def score(self, prompt_ids: TokenIds, response_ids: TokenIds) -> list[float]:
        raise NotImplementedError

    def score_samples(self, prompt_ids: TokenIds, response_ids: TokenIds,
                      rows: Optional[Sequence[dict]] = None) -> list[float]:
        """``score`` with each prompt's dataset row (``rows[i]``, all its columns) at hand; a reward
        model ignores them, a reward function (``homerlhf.ppo.reward_functions``) reads them."""
        return self.score(prompt_ids, response_ids)

    def submit_score(self, prompt_ids: TokenIds, response_ids: TokenIds,
                     rows: Optional[Sequence[dict]] = None) -> "Future[list[float]]":
        if self.shares_policy or self.on_trainer_cpu:
            return _completed(self.score_samples, prompt_ids, response_ids, rows)
        return self._submit(self.score_samples, prompt_ids, response_ids, rows)

    def take_component_scores(self) -> dict[str, list]:
        """Per-reward scores since the last call, by reward name (a weighted sum of rewards has them)."""
        return {}


class CallableReward(RewardBackend):
    """A Python function as the reward model (tests, rule-based rewards)."""

    def __init__(self, fn: Callable[[list[int], list[int]], float]):
        self.fn = fn

    def score(self, prompt_ids: TokenIds, response_ids: TokenIds) -> list[float]:
        return [float(self.fn(list(p), list(r))) for p, r in zip(prompt_ids, response_ids)]


def _completed(fn, *args) -> Future:
    future: Future = Future()
    try:
        future.set_result(fn(*args))
    except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
        future.set_exception(exc)
    return future


class AdapterOffReference(ReferenceBackend):
    """The policy's own 4-bit base with every adapter disabled: no extra memory, exact base weights.

    Log-probs are taken at the policy's sampling temperature (``policy.temperature``, passed into
    the chunked computation by ``PolicyModel.reference_logprobs``), like the actor's.

    It shares the policy's modules, so it must not run concurrently with a policy forward:
    ``submit_logprobs`` computes in the caller's thread and returns a finished future. An
    out-of-memory error halves its batch (down to 1, for the rest of the run) and scores again.
    """

    uses_policy = True

    def __init__(self, policy, batch_size: int = 8):
        self.policy = policy  # a homerlhf.models.policy.PolicyModel
        self.batch_size = batch_size

    def logprobs(self, prompt_ids: TokenIds, response_ids: TokenIds) -> list[list[float]]:
        from homerlhf.memory.oom import halved_after_oom

        out: list[list[float]] = []
        start = 0
        while start < len(prompt_ids):
            end = min(len(prompt_ids), start + self.batch_size)
            try:
                out.extend(self._batch(prompt_ids[start:end], response_ids[start:end]))
            except BaseException as exc:  # noqa: BLE001 - halved_after_oom re-raises all but an OOM
                self.batch_size = halved_after_oom(exc, end - start, "reference scoring")
                continue
            start = end
        return out

    def _batch(self, prompts: TokenIds, responses: TokenIds) -> list[list[float]]:
        import torch

        from homerlhf.ppo.rollout import pad_sequences

        pad = self.policy.tokenizer.pad_token_id
        # Prompts left-padded, responses right-padded to a common width: the policy's layout.
        p_ids, p_mask = pad_sequences(prompts, pad, "left", self.policy.device)
        r_ids, r_mask = pad_sequences(responses, pad, "right", self.policy.device)
        ids = torch.cat([p_ids, r_ids], dim=1)
        mask = torch.cat([p_mask, r_mask], dim=1)
        lp = self.policy.reference_logprobs(ids, mask, r_ids.shape[1])
        return [row[:len(r)].tolist() for row, r in zip(lp.float().cpu(), responses)]

    def submit_logprobs(self, prompt_ids: TokenIds, response_ids: TokenIds) -> "Future[list[list[float]]]":
        return _completed(self.logprobs, prompt_ids, response_ids)


class HFReward(RewardBackend):
    """An in-process HF ``*ForSequenceClassification`` (num_labels 1): the score at the last token
    of prompt + response (:func:`homerlhf.models.scores.sequence_scores`).

    ``model_path`` is an HF model dir, a hub id, or a reward-stage run dir (its ``model/`` is used).
    On a GPU it scores in a worker thread, so it overlaps the policy's GPU work; on the CPU in the
    caller's thread (``on_trainer_cpu``): measured on 2 cores (docs/time.md), scoring beside the
    trainer made the tiny model's whole iteration 2.4x slower (5.7 s against 2.3 s).
    """

    def __init__(self, model_path: str, device: str = "cpu", dtype=None, batch_size: int = 8,
                 trust_remote_code: bool = False):
        import torch
        from transformers import AutoModelForSequenceClassification

        path = Path(model_path)
        if (path / "model").is_dir():
            path = path / "model"
        try:
            self.model = AutoModelForSequenceClassification.from_pretrained(
                str(path) if path.exists() else model_path,
                dtype=dtype or torch.float32,
                trust_remote_code=trust_remote_code,
            ).to(device)
        except OSError as exc:
            raise UserError(
                f"cannot load reward model '{model_path}': {str(exc).splitlines()[0]} "
                "(give a reward run dir, an HF sequence-classification dir or a hub id)"
            ) from None
        if self.model.config.num_labels != 1:
            raise UserError(
                f"reward model '{model_path}' has {self.model.config.num_labels} labels; a reward model "
                "needs num_labels=1 (train one with `homerlhf reward`)"
            )
        self.model.eval()
        self.model.requires_grad_(False)
        self.device = device
        self.on_trainer_cpu = torch.device(device).type == "cpu"
        self.batch_size = batch_size
        self.pad_id = self.model.config.pad_token_id if self.model.config.pad_token_id is not None else 0
        self.source_path = str(path)

    def score(self, prompt_ids: TokenIds, response_ids: TokenIds) -> list[float]:
        from homerlhf.models.scores import score_sequences

        # Prompt + response per sample, unpadded; read at the last real token (never "the last
        # non-pad id", which misfires when pad == eos).
        rows = [list(p) + list(r) for p, r in zip(prompt_ids, response_ids)]
        return score_sequences(self.model, rows, self.pad_id, self.batch_size).tolist()


class AdapterReward(RewardBackend):
    """``reward.backend: adapter``: a reward model's LoRA + score head on the policy's own 4-bit base
    (:class:`homerlhf.models.reward_adapter.RewardAdapter`), scored at GPU speed with no second copy
    of the base. The score of a sample is read at the last token of prompt + response, as every
    other reward backend reads it.

    It shares the policy's modules (``shares_policy``): ``submit_score`` computes in the caller's
    thread and returns a finished future. An out-of-memory error halves the scorer's batch (down to
    1, for the rest of the run) and scores again.
    """

    shares_policy = True

    def __init__(self, scorer):
        self.scorer = scorer  # a homerlhf.models.reward_adapter.RewardAdapter

    def score(self, prompt_ids: TokenIds, response_ids: TokenIds) -> list[float]:
        from homerlhf.memory.oom import halved_after_oom

        sequences = [list(p) + list(r) for p, r in zip(prompt_ids, response_ids)]
        while True:
            try:
                return self.scorer.scores(sequences).tolist()
            except BaseException as exc:  # noqa: BLE001 - halved_after_oom re-raises all but an OOM
                self.scorer.batch_size = halved_after_oom(exc, self.scorer.batch_size, "reward scoring")

    def close(self) -> None:
        self.scorer.unload()
        super().close()


@dataclass
class Backends:
    """What an iteration's samples are drawn and scored by: the reference, the reward and the rollout
    engine (None: the actor's own ``generate``, :class:`homerlhf.ppo.engines.HFEngine`)."""

    reference: ReferenceBackend
    reward: RewardBackend
    engine: Optional["RolloutEngine"] = None

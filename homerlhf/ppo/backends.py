"""The two interfaces the trainer scores through: a reference model and a reward model.

Both take token ids (never text) as lists, one entry per sample, so the same calls work for an
in-process model and for a llama.cpp worker across HTTP. ``submit_*`` returns a future so the
trainer can overlap CPU scoring with GPU work; the base classes run the call in a worker thread.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Sequence

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

    def logprobs(self, prompt_ids: TokenIds, response_ids: TokenIds) -> list[list[float]]:
        """Returns one list per sample with ``len(response_ids[i])`` floats:
        ``log p_ref(response[t] | prompt, response[:t])``."""
        raise NotImplementedError

    def submit_logprobs(self, prompt_ids: TokenIds, response_ids: TokenIds) -> "Future[list[list[float]]]":
        return self._submit(self.logprobs, prompt_ids, response_ids)


class RewardBackend(_Async):
    """One scalar score per (prompt, response)."""

    def score(self, prompt_ids: TokenIds, response_ids: TokenIds) -> list[float]:
        raise NotImplementedError

    def submit_score(self, prompt_ids: TokenIds, response_ids: TokenIds) -> "Future[list[float]]":
        return self._submit(self.score, prompt_ids, response_ids)


class CallableReward(RewardBackend):
    """A Python function as the reward model (tests, rule-based rewards)."""

    def __init__(self, fn: Callable[[list[int], list[int]], float]):
        self.fn = fn

    def score(self, prompt_ids: TokenIds, response_ids: TokenIds) -> list[float]:
        return [float(self.fn(list(p), list(r))) for p, r in zip(prompt_ids, response_ids)]

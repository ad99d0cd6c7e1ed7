"""Dynamic micro-batching: on an out-of-memory error in a phase, free, halve the micro-batch (update,
:func:`run_with_backoff`) or the rollout chunk (generation, scoring: :func:`halved_after_oom`), redo.

On CPU the same path is exercised by an injected fault: a step calls :func:`maybe_raise` where a
forward would allocate, and a test wraps the run in ``with inject_oom_at(micro_batch_size=8): ...``
to make that call raise :class:`SimulatedOOM` once.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import traceback
from typing import Callable, Iterator, Optional, TypeVar

import torch

from homerlhf.errors import UserError

T = TypeVar("T")
log = logging.getLogger(__name__)


class SimulatedOOM(RuntimeError):
    """An injected stand-in for ``torch.cuda.OutOfMemoryError`` (tests, CPU)."""


class OutOfMemoryAtMicroBatch1(UserError):
    """Still out of memory with one sample per forward: only a smaller setting can help."""

    def __init__(self, phase: str, exc: BaseException):
        what = f" in {phase}" if phase else ""
        super().__init__(
            f"out of GPU memory{what} even with micro_batch_size=1 ({type(exc).__name__}); "
            "lower rollout.max_new_tokens / rollout.max_prompt_len or rollout.chunk_size, set "
            "training.gradient_checkpointing=true and an 8-bit optimizer (actor.optimizer=paged_adamw_8bit), "
            "or check the plan with `homerlhf plan`",
            exit_code=1,
        )


# What a RuntimeError says when the device ran out of memory without torch's typed error: bitsandbytes
# and older kernels ("out of memory"), and cuBLAS / cuDNN failing to allocate their handle or workspace
# (torch's TORCH_CUDABLAS_CHECK and cuDNN checks raise a plain RuntimeError naming the status).
OOM_TEXTS = ("out of memory", "cublas_status_alloc_failed", "cudnn_status_alloc_failed")


def is_oom(exc: BaseException) -> bool:
    """True for a CUDA OOM (typed, or a plain RuntimeError with one of :data:`OOM_TEXTS`) or a simulated one."""
    if isinstance(exc, SimulatedOOM):
        return True
    oom_type = getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None)
    if oom_type is not None and isinstance(exc, oom_type):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(t in text for t in OOM_TEXTS)


def free_memory() -> None:
    """Drop unreachable tensors and hand cached CUDA blocks back (a retry after an OOM, a model dropped).

    The collection comes first and is not optional: bitsandbytes' ``Params4bit.module`` points back at
    its ``Linear4bit`` (``bitsandbytes/nn/modules.py``, ``Linear4bit.__init__``), so a dropped 4-bit
    model is a reference cycle that holds its weights until the cyclic GC runs; ``empty_cache`` alone
    would hand back nothing."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class OOMInjector:
    """Raises ``SimulatedOOM`` the first ``times`` calls of ``maybe_raise(n)`` with ``n >= at``.

    ``n >= at`` (not ``==``) so a fault at 8 also hits a step that starts at 16, like a real card
    that runs out of memory at any micro-batch at least that large.
    """

    def __init__(self, micro_batch_size: int, times: int = 1):
        if micro_batch_size < 1 or times < 0:
            raise ValueError("micro_batch_size must be >= 1 and times >= 0")
        self.at = micro_batch_size
        self.remaining = times
        self.raised: list[int] = []  # the micro-batch sizes at which a fault was injected

    def maybe_raise(self, micro_batch_size: int) -> None:
        if self.remaining > 0 and micro_batch_size >= self.at:
            self.remaining -= 1
            self.raised.append(micro_batch_size)
            raise SimulatedOOM(f"simulated CUDA out of memory at micro_batch_size={micro_batch_size}")


_lock = threading.Lock()
_active: list[OOMInjector] = []


@contextlib.contextmanager
def inject_oom_at(micro_batch_size: int = 8, times: int = 1) -> Iterator[OOMInjector]:
    """Within the block, ``maybe_raise(n)`` raises ``SimulatedOOM`` ``times`` times for ``n >= micro_batch_size``."""
    injector = OOMInjector(micro_batch_size, times)
    with _lock:
        _active.append(injector)
    try:
        yield injector
    finally:
        with _lock:
            _active.remove(injector)


def maybe_raise(micro_batch_size: int) -> None:
    """Called by step functions where a forward allocates; a no-op unless a fault is injected."""
    if not _active:  # the hot path: no lock, no work
        return
    with _lock:
        injectors = list(_active)
    for injector in injectors:
        injector.maybe_raise(micro_batch_size)


class OutOfMemoryAtChunk1(UserError):
    """Still out of memory generating or scoring one prompt at a time."""

    def __init__(self, phase: str, exc: BaseException):
        super().__init__(
            f"out of GPU memory in {phase} even with rollout.chunk_size=1 ({type(exc).__name__}); "
            "lower rollout.max_new_tokens / rollout.max_prompt_len or ppo.logprob_chunk_size, "
            "or check the plan with `homerlhf plan`",
            exit_code=1,
        )


def halved_after_oom(exc: BaseException, chunk_size: int, phase: str) -> int:
    """The rollout chunk to redo with after ``exc`` in ``phase`` (generation or scoring): half of
    ``chunk_size``. Re-raises ``exc`` when it is no OOM; :class:`OutOfMemoryAtChunk1` at chunk 1.
    Frees what the failed step held (call it inside the ``except`` block)."""
    if not is_oom(exc):
        raise exc
    if chunk_size <= 1:
        raise OutOfMemoryAtChunk1(phase, exc) from exc
    new_size = max(1, chunk_size // 2)
    log.warning("out of memory in %s at rollout chunk %d; redoing the chunk with %d", phase, chunk_size, new_size)
    traceback.clear_frames(exc.__traceback__)  # the frames hold the failed step's activations
    free_memory()
    return new_size


def run_with_backoff(
    step_fn: Callable[[int], T],
    micro_batch_size: int,
    *,
    on_retry: Optional[Callable[[int, int, BaseException], None]] = None,
    phase: str = "",
) -> T:
    """``step_fn(micro_batch_size)``; on OOM free memory, halve the micro-batch (to 1) and redo.

    ``on_retry(old, new, exc)`` is called before each redo (log it). At micro-batch 1 an OOM raises
    ``OutOfMemoryAtMicroBatch1`` (a ``UserError`` naming settings that lower memory), chained to the
    original error. Any other exception passes through untouched. The contract with ``step_fn``:

    - it does **all** the work of one phase for one mini-batch (zero grads, forward/backward over the
      mini-batch in micro-batches of ``micro_batch_size`` samples, accumulate), and it
    - **zeroes the gradients at its start** (``optimizer.zero_grad(set_to_none=True)``), and
    - does **not** call ``optimizer.step()``: the caller steps only after ``run_with_backoff`` returns.

    Then a retry after an OOM half-way through the micro-batches starts from clean gradients, and the
    optimizer step sees the gradients of exactly one full pass: none lost, none applied twice. For the
    result not to depend on the micro-batch size, ``step_fn`` weights each micro-batch's loss by its
    share of the mini-batch (its rows, or its tokens for a token mean).
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    size = micro_batch_size
    while True:
        try:
            return step_fn(size)
        except BaseException as exc:  # noqa: BLE001 - filtered by is_oom, everything else re-raised
            if not is_oom(exc):
                raise
            if size <= 1:
                raise OutOfMemoryAtMicroBatch1(phase, exc) from exc
            new_size = max(1, size // 2)
            log.warning("out of memory%s at micro_batch_size=%d; retrying with %d",
                        f" in {phase}" if phase else "", size, new_size)
            if on_retry is not None:
                on_retry(size, new_size, exc)
            # The traceback's frames hold the failed step's activations; release them before freeing.
            traceback.clear_frames(exc.__traceback__)
            size = new_size
        # Outside the except block the exception (and with it the frames) is unreachable.
        free_memory()

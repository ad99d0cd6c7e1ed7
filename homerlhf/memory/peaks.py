"""Measured memory peaks per PPO phase: ``with meter.phase("generation"): ...``.

On CUDA a phase's peak is ``torch.cuda.max_memory_allocated`` with the counter reset when the phase
starts, which is what the planner predicts as a phase's allocated bytes (without CUDA context and
allocator slack). On CPU it is the process's resident set size (psutil): sampled at the start, at
the end and by a background thread every ``interval_s`` in between. A phase entered several times
(one per rollout chunk, one per mini-batch) keeps the largest peak; nested phases are allowed and
the outer one's peak includes the inner one's.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Iterator, Optional, Union

import psutil
import torch

GIB = 1024**3


@dataclass
class _Frame:
    name: str
    high: int = 0  # bytes seen by this phase before the counter was last reset


class _CudaCounter:
    def __init__(self, device: torch.device):
        self.device = device

    def reset(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def read(self) -> int:
        torch.cuda.synchronize(self.device)
        return int(torch.cuda.max_memory_allocated(self.device))

    def close(self) -> None:
        pass


class _RssCounter:
    """Process RSS high-water since the last reset, sampled by a daemon thread."""

    def __init__(self, interval_s: float):
        self.proc = psutil.Process()
        self.interval_s = interval_s
        self.high = self.proc.memory_info().rss
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread: Optional[threading.Thread] = None
        if interval_s > 0:
            self.thread = threading.Thread(target=self._run, name="PhaseMeter-rss", daemon=True)
            self.thread.start()

    def _sample(self) -> int:
        rss = self.proc.memory_info().rss
        with self.lock:
            self.high = max(self.high, rss)
            return self.high

    def _run(self) -> None:
        while not self.stop.wait(self.interval_s):
            self._sample()

    def reset(self) -> None:
        rss = self.proc.memory_info().rss
        with self.lock:
            self.high = rss

    def read(self) -> int:
        return self._sample()

    def close(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout=1.0)


@dataclass
class PhaseMeter:
    """Peak memory per named phase, in GiB.

    ``device``: "cuda"/"cuda:N" (``max_memory_allocated``), "cpu" (process RSS) or None (CUDA if
    available). ``interval_s``: RSS sampling period on CPU (0: start and end samples only).
    """

    device: Optional[Union[str, torch.device]] = None
    interval_s: float = 0.05
    _peaks: dict[str, int] = field(default_factory=dict, init=False)
    _stack: list[_Frame] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(self.device)
        self.kind = "cuda_max_allocated" if self.device.type == "cuda" else "cpu_rss"
        self._counter = _CudaCounter(self.device) if self.device.type == "cuda" else _RssCounter(self.interval_s)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        # The counter is shared: before resetting it for the new phase, credit what it has seen so
        # far to every phase already open, so an outer phase still sees its own earlier peak.
        if self._stack:
            seen = self._counter.read()
            for frame in self._stack:
                frame.high = max(frame.high, seen)
        self._counter.reset()
        frame = _Frame(name)
        self._stack.append(frame)
        try:
            yield
        finally:
            self._stack.pop()
            peak = max(frame.high, self._counter.read())
            self._peaks[name] = max(self._peaks.get(name, 0), peak)
            # The counter keeps running, so the outer phase's own read at its end includes this peak.

    def peaks(self) -> dict[str, float]:
        """``{phase: peak GiB}`` over every time each phase was entered."""
        return {name: value / GIB for name, value in self._peaks.items()}

    def peak_bytes(self) -> dict[str, int]:
        return dict(self._peaks)

    def reset(self) -> None:
        """Forget recorded peaks (e.g. at the start of each iteration)."""
        self._peaks.clear()

    def close(self) -> None:
        """Stop the RSS sampling thread (CPU). Safe to call twice."""
        self._counter.close()

    def __enter__(self) -> "PhaseMeter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

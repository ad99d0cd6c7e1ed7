"""What an iteration measures about itself: wall seconds per stage, peak memory per phase.

The rollout and the update time themselves through one :class:`Meters` (``stage(name)``); the trainer
resets it when an iteration starts and reads it into the metrics row (``time_*_s``, ``peak_mem_*``).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional


@dataclass
class StageTimes:
    """Wall seconds of each stage of one iteration (the ``time_*_s`` metrics)."""

    generation: float = 0.0
    scoring: float = 0.0
    reference_reward_wait: float = 0.0
    advantages: float = 0.0
    update: float = 0.0


@dataclass
class Meters:
    """The stage times and the memory meter (a :class:`homerlhf.memory.peaks.PhaseMeter`, or None) of
    the iteration in progress; ``started``: ``time.perf_counter()`` when it began."""

    memory: Optional[object] = None
    times: StageTimes = field(default_factory=StageTimes)
    started: float = field(default_factory=time.perf_counter)

    def reset(self) -> None:
        self.times, self.started = StageTimes(), time.perf_counter()
        if self.memory is not None:
            self.memory.reset()

    @contextlib.contextmanager
    def stage(self, name: str, memory: bool = True) -> Iterator[None]:
        """Adds the block's wall seconds to ``times.<name>``; with ``memory``, the block is the memory
        phase ``name`` too (generation, scoring, update)."""
        t0 = time.perf_counter()
        with self.phase(name) if memory else contextlib.nullcontext():
            yield
        setattr(self.times, name, getattr(self.times, name) + time.perf_counter() - t0)

    def phase(self, name: str):
        """The memory phase ``name`` alone (no time taken), or nothing without a memory meter."""
        return self.memory.phase(name) if self.memory is not None else contextlib.nullcontext()

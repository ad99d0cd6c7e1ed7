"""CPU threads per process: the physical cores split between the local llama.cpp workers and, when
it computes on the CPU, the trainer.

Each llama.cpp worker defaulting to every core (and torch in the trainer doing the same) puts two or
three times as many busy threads as cores on the machine: they preempt each other mid-matmul and the
whole iteration slows down. Physical cores, not logical ones: two hyper-threads of one core share its
vector units, so a second thread per core adds little to a matmul.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from homerlhf.config.schema import RunConfig


@dataclass(frozen=True)
class ThreadShares:
    """Threads for each local worker and for the trainer (0 when it runs on the GPU: not ours to set)."""

    worker: int
    trainer: int


def physical_cores() -> int:
    """Physical cores this process may run on: the machine's (psutil, else the logical count), at most
    the CPUs of its affinity mask (``taskset``, a container's cpuset, a test process pinned to its
    share), at least 1. A process confined to one CPU that split two cores' threads would run twice
    as many busy threads as it has CPUs."""
    import psutil

    cores = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    if hasattr(os, "sched_getaffinity"):
        cores = min(cores, len(os.sched_getaffinity(0)))
    return max(1, cores)


def split_threads(cores: int, local_workers: int, trainer_on_cpu: bool) -> ThreadShares:
    """``cores`` split evenly between ``local_workers`` and (when ``trainer_on_cpu``) the trainer;
    the remainder goes to the trainer, whose torch ops run in every phase. At least 1 thread each,
    even where that oversubscribes a machine with fewer cores than processes."""
    sharers = local_workers + (1 if trainer_on_cpu else 0)
    if sharers == 0:
        return ThreadShares(worker=0, trainer=0)
    share = max(1, cores // sharers)
    trainer = max(1, cores - share * local_workers) if trainer_on_cpu else 0
    return ThreadShares(worker=share if local_workers else 0, trainer=trainer)


def local_worker_roles(cfg: "RunConfig") -> list[str]:
    """The roles (``ref``, ``reward``) a PPO run of ``cfg`` serves from a llama.cpp worker of its own."""
    return [role for role in ("ref", "reward")
            if getattr(cfg, role).backend == "llamacpp" and not getattr(cfg, role).url]


def run_thread_shares(cfg: "RunConfig", cores: int | None = None) -> ThreadShares:
    """The default shares of a PPO run of ``cfg`` on this machine (``cores``: physical cores)."""
    return split_threads(physical_cores() if cores is None else cores, len(local_worker_roles(cfg)),
                         cfg.card.device == "cpu")

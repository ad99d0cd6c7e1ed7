"""The physical cores split between a run's local llama.cpp workers and a trainer on CPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from homerlhf.config import load_config
from homerlhf.memory import threads
from homerlhf.memory.threads import ThreadShares, local_worker_roles, run_thread_shares, split_threads


@pytest.mark.parametrize("cores, workers, trainer_on_cpu, want", [
    (16, 2, True, ThreadShares(worker=5, trainer=6)),   # 16 // 3 = 5 each; the remainder 1 to the trainer
    (16, 2, False, ThreadShares(worker=8, trainer=0)),  # GPU trainer: the workers split all 16
    (16, 1, True, ThreadShares(worker=8, trainer=8)),
    (8, 1, False, ThreadShares(worker=8, trainer=0)),
    (6, 0, True, ThreadShares(worker=0, trainer=6)),    # adapter_off ref + hf reward: all to torch
    (7, 2, True, ThreadShares(worker=2, trainer=3)),    # 7 // 3 = 2; 7 - 2*2 = 3
    (2, 2, True, ThreadShares(worker=1, trainer=1)),    # fewer cores than processes: 1 each, never 0
    (1, 2, False, ThreadShares(worker=1, trainer=0)),
    (4, 0, False, ThreadShares(worker=0, trainer=0)),
])
def test_split_by_hand(cores, workers, trainer_on_cpu, want):
    assert split_threads(cores, workers, trainer_on_cpu) == want


def test_workers_never_take_more_than_the_cores_between_them():
    for cores in range(3, 65):
        for workers in (1, 2):
            for on_cpu in (False, True):
                got = split_threads(cores, workers, on_cpu)
                assert got.worker * workers + got.trainer <= cores
                assert got.worker * workers + got.trainer >= cores - workers  # at most a remainder idles


def test_run_shares_follow_the_config(preset_named):
    cfg = load_config("cpu-tiny", None, [])
    assert local_worker_roles(cfg) == ["ref", "reward"]
    assert run_thread_shares(cfg, cores=16) == ThreadShares(5, 6)
    remote = load_config("cpu-tiny", None, ["ref.url=http://cpu-box:8601", "reward.backend=hf"])
    assert local_worker_roles(remote) == []
    assert run_thread_shares(remote, cores=16) == ThreadShares(0, 16)
    gpu = preset_named()  # its workers on llama.cpp
    assert run_thread_shares(gpu, cores=16) == ThreadShares(8, 0)


def test_physical_cores_is_psutils_count_within_the_affinity_mask(monkeypatch):
    import psutil

    cores = max(1, psutil.cpu_count(logical=False) or 1)
    assert threads.physical_cores() == min(cores, len(os.sched_getaffinity(0)))
    monkeypatch.setattr(psutil, "cpu_count", lambda logical=True: 2 if not logical else 4)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
    assert threads.physical_cores() == 1  # one CPU allowed: one, not the machine's two
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert threads.physical_cores() == 2  # the mask allows more CPUs than the machine has cores


def test_a_process_pinned_to_one_cpu_splits_one_core():
    """As under ``taskset -c 0`` or a container's cpuset: the real mask, set in a process of its own."""
    code = ("import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
            "from homerlhf.memory.threads import physical_cores, split_threads; "
            "print(physical_cores(), split_threads(physical_cores(), 2, True))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.strip() == "1 ThreadShares(worker=1, trainer=1)"

"""The physical cores split between a run's local llama.cpp workers and a trainer on CPU."""

from __future__ import annotations

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


def test_physical_cores_is_psutils_count():
    import psutil

    assert threads.physical_cores() == max(1, psutil.cpu_count(logical=False) or 1)

"""PhaseMeter on CPU: process RSS high-water per phase, nested phases, repeated phases."""

from __future__ import annotations

import numpy as np

from homerlhf.memory.peaks import GIB, PhaseMeter


def _touch(n_bytes: int) -> np.ndarray:
    buf = np.ones(n_bytes, dtype=np.uint8)  # ones, not empty: the pages must be resident
    return buf


def test_cpu_phase_peak_sees_a_transient_allocation():
    with PhaseMeter(device="cpu", interval_s=0.0) as meter:
        assert meter.kind == "cpu_rss"
        with meter.phase("idle"):
            pass
        with meter.phase("generation"):
            buf = _touch(256 * 1024**2)
            # Freed before the phase ends: only a sample inside the phase can see it.
            meter._counter.read()
            del buf
        peaks = meter.peaks()
    assert set(peaks) == {"idle", "generation"}
    assert peaks["generation"] - peaks["idle"] > 0.2  # 256 MiB = 0.25 GiB
    assert all(isinstance(v, float) for v in peaks.values())


def test_background_sampler_and_nesting():
    import time

    with PhaseMeter(device="cpu", interval_s=0.005) as meter:
        with meter.phase("update"):
            with meter.phase("inner"):
                buf = _touch(192 * 1024**2)
                time.sleep(0.05)  # the sampler thread sees it; no explicit read
                del buf
            with meter.phase("after"):
                pass
        with meter.phase("update"):  # a second, smaller visit keeps the larger peak
            pass
        bytes_ = meter.peak_bytes()
    assert bytes_["inner"] - bytes_["after"] > 150 * 1024**2
    assert bytes_["update"] >= bytes_["inner"]  # the outer phase includes the inner peak
    meter.reset()
    assert meter.peaks() == {}
    assert GIB == 2**30

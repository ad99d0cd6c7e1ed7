"""RunningMoments against torch.mean/std of everything seen, and normalize_scores by hand."""

from __future__ import annotations

import math

import pytest
import torch

from homerlhf.ppo.running import RunningMoments, normalize_scores


def test_running_moments_by_hand():
    rm = RunningMoments()
    assert (rm.mean, rm.std, rm.count) == (0.0, 1.0, 0)  # nothing seen: identity normalisation
    # [1, 2, 3]: mean 2, unbiased std sqrt(((-1)^2 + 0 + 1^2) / 2) = 1
    assert rm.update(torch.tensor([1.0, 2.0, 3.0])) == pytest.approx((2.0, 1.0), abs=1e-12)
    assert rm.mean == pytest.approx(2.0, abs=1e-12) and rm.std == pytest.approx(1.0, abs=1e-12)
    # + [5]: all = [1, 2, 3, 5], mean 11/4 = 2.75; deviations -1.75, -0.75, 0.25, 2.25;
    # squares 3.0625 + 0.5625 + 0.0625 + 5.0625 = 8.75; unbiased var 8.75/3 = 2.9166667,
    # std 1.7078251. The one-value batch reports std 0.
    assert rm.update(torch.tensor([5.0])) == pytest.approx((5.0, 0.0), abs=1e-12)
    assert rm.mean == pytest.approx(2.75, abs=1e-6)
    assert rm.std == pytest.approx(1.7078251, abs=1e-6)
    assert rm.count == 4


def test_running_moments_match_concatenation():
    g = torch.Generator().manual_seed(3)
    rm = RunningMoments()
    seen = []
    # Uneven batch sizes, shapes and offsets; a large offset checks numerical stability.
    for i, size in enumerate([1, 7, 64, 3, 1, 250, 2]):
        batch = torch.randn(size, generator=g, dtype=torch.float64) * (i + 1) + 1e4
        if size == 64:
            batch = batch.view(8, 8)
        batch_mean, batch_std = rm.update(batch.float() if i % 2 else batch)
        x = batch.float().double() if i % 2 else batch
        seen.append(x.flatten())
        assert batch_mean == pytest.approx(x.mean().item(), abs=1e-6)
        if size > 1:
            assert batch_std == pytest.approx(x.std().item(), abs=1e-6)
        everything = torch.cat(seen)
        assert rm.mean == pytest.approx(everything.mean().item(), abs=1e-6)
        if rm.count > 1:
            assert rm.std == pytest.approx(everything.std().item(), abs=1e-6)
        assert rm.count == everything.numel()


def test_state_dict_round_trip():
    rm = RunningMoments()
    rm.update(torch.tensor([1.0, 4.0, 9.0]))
    resumed = RunningMoments()
    resumed.load_state_dict(rm.state_dict())
    rm.update(torch.tensor([2.0, -3.0]))
    resumed.update(torch.tensor([2.0, -3.0]))
    assert (resumed.mean, resumed.std, resumed.count) == (rm.mean, rm.std, rm.count)


def test_empty_update_is_an_error():
    with pytest.raises(ValueError, match="empty"):
        RunningMoments().update(torch.tensor([]))


def test_normalize_scores_by_hand():
    scores = torch.tensor([1.0, 2.0, 3.0, 10.0])
    # (s - 2) / 0.5 = [-2, 0, 2, 16]
    torch.testing.assert_close(normalize_scores(scores, 2.0, 0.5), torch.tensor([-2.0, 0.0, 2.0, 16.0]))
    # clipped to +-1.5: [-1.5, 0, 1.5, 1.5]
    torch.testing.assert_close(
        normalize_scores(scores, 2.0, 0.5, clip=1.5), torch.tensor([-1.5, 0.0, 1.5, 1.5])
    )
    # std 0 (a constant history) is floored at 1e-8 instead of dividing by zero
    out = normalize_scores(torch.tensor([2.0, 2.0]), 2.0, 0.0)
    assert torch.isfinite(out).all() and out.tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="clip"):
        normalize_scores(scores, 0.0, 1.0, clip=0.0)
    assert math.isclose(normalize_scores(torch.tensor([7.0]), 3.0, 2.0).item(), 2.0)

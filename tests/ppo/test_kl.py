"""KL controllers against numbers derived by hand."""

from __future__ import annotations

import pytest
import torch

from homerlhf.config.schema import PPOConfig
from homerlhf.ppo.kl import AdaptiveKLController, FixedKLController, build_kl_controller


def test_adaptive_kl_controller_by_hand():
    ctl = AdaptiveKLController(init_kl_coef=0.1, target=6.0, horizon=10000)
    assert ctl.value == pytest.approx(0.1, abs=1e-12)
    # KL 9 > target: e = 9/6 - 1 = 0.5, clipped to 0.2; mult = 1 + 0.2 * 256 / 10000 = 1.00512
    # value = 0.1 * 1.00512 = 0.100512
    ctl.update(9.0, n_steps=256)
    assert ctl.value == pytest.approx(0.100512, abs=1e-9)
    # KL 5.4 < target: e = 0.9 - 1 = -0.1 (inside the clip); mult = 1 - 0.1 * 100 / 10000 = 0.999
    # value = 0.100512 * 0.999 = 0.100411488
    ctl.update(5.4, n_steps=100)
    assert ctl.value == pytest.approx(0.100411488, abs=1e-9)
    # KL 0: e = -1 clipped to -0.2; n_steps = horizon: mult = 0.8 -> 0.0803291904
    ctl.update(torch.tensor(0.0), n_steps=10000)  # a 0-dim tensor works as well as a float
    assert ctl.value == pytest.approx(0.0803291904, abs=1e-9)
    # KL exactly at target: e = 0, nothing moves
    ctl.update(6.0, n_steps=5000)
    assert ctl.value == pytest.approx(0.0803291904, abs=1e-9)


def test_fixed_kl_controller_never_moves():
    ctl = FixedKLController(0.05)
    for kl in (0.0, 100.0, -3.0):
        ctl.update(kl, n_steps=1000)
    assert ctl.value == 0.05


def test_state_dict_round_trip():
    ctl = AdaptiveKLController(0.2, target=1.0, horizon=100)
    ctl.update(2.0, n_steps=10)  # 0.2 * (1 + 0.2 * 10 / 100) = 0.204
    resumed = AdaptiveKLController(0.2, target=1.0, horizon=100)
    resumed.load_state_dict(ctl.state_dict())
    assert resumed.value == pytest.approx(0.204, abs=1e-12)
    ctl.update(0.5, n_steps=10)
    resumed.update(0.5, n_steps=10)
    assert resumed.value == ctl.value

    fixed = FixedKLController(0.3)
    other = FixedKLController(0.0)
    other.load_state_dict(fixed.state_dict())
    assert other.value == 0.3


def test_build_kl_controller_from_config():
    fixed = build_kl_controller(PPOConfig(kl_coef=0.07))
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.07
    adaptive = build_kl_controller(PPOConfig(kl_coef=0.07, adaptive_kl=True, target_kl=3.0, kl_horizon=50))
    assert isinstance(adaptive, AdaptiveKLController)
    assert (adaptive.value, adaptive.target, adaptive.horizon) == (0.07, 3.0, 50)


def test_invalid_arguments():
    with pytest.raises(ValueError, match="target"):
        AdaptiveKLController(0.1, target=0.0, horizon=10)
    with pytest.raises(ValueError, match="horizon"):
        AdaptiveKLController(0.1, target=1.0, horizon=0)
    with pytest.raises(ValueError, match="kl_coef"):
        FixedKLController(-0.1)

"""KL penalty controllers: the coefficient ``kl_coef`` (beta) of the per-token KL penalty.

Each exposes ``.value`` and ``.update(current_kl, n_steps)``, and ``state_dict()`` /
``load_state_dict()`` so a resumed run continues with the coefficient it had reached.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from homerlhf.config.schema import PPOConfig


class AdaptiveKLController:
    """Steers the observed KL towards ``target`` (Ziegler et al. 2019, "Fine-Tuning Language
    Models from Human Preferences", section 2.2).

    ``update(current_kl, n_steps)``:
    ``e = clip(current_kl / target - 1, -0.2, 0.2)``; ``value *= 1 + e * n_steps / horizon``.

    ``current_kl`` is on the same scale as ``target``: in the paper (and our ``target_kl`` default
    of 6) the mean over samples of the KL summed over each response's tokens, and ``n_steps`` is
    the number of samples in the iteration, so ``horizon`` counts samples.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: int):
        if init_kl_coef < 0:
            raise ValueError(f"init_kl_coef must be >= 0, got {init_kl_coef}")
        if target <= 0:
            raise ValueError(f"target must be > 0, got {target}")
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


class FixedKLController:
    """A constant ``kl_coef``; ``update`` does nothing."""

    def __init__(self, kl_coef: float):
        if kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


KLController = AdaptiveKLController | FixedKLController


def build_kl_controller(ppo_config: "PPOConfig") -> KLController:
    """The controller the ``ppo`` config section asks for (``kl_coef``, ``adaptive_kl``,
    ``target_kl``, ``kl_horizon``)."""
    if ppo_config.adaptive_kl:
        return AdaptiveKLController(ppo_config.kl_coef, ppo_config.target_kl, ppo_config.kl_horizon)
    return FixedKLController(ppo_config.kl_coef)

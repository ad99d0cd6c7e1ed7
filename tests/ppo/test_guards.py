"""The non-finite guard: bad steps are skipped and counted; N in a row stop with one clear line."""

from __future__ import annotations

import math

import pytest
import torch

from homerlhf.errors import UserError
from homerlhf.ppo.guards import NonFiniteError, NonFiniteGuard, grads_finite, is_finite


def test_is_finite_and_grads_finite():
    assert is_finite(1.0) and is_finite(torch.tensor([1.0, -2.0]))
    assert not is_finite(math.nan) and not is_finite(torch.tensor([1.0, math.inf]))
    w = torch.nn.Parameter(torch.ones(2))
    b = torch.nn.Parameter(torch.ones(1))  # no grad: ignored
    (w * torch.tensor([1.0, 2.0])).sum().backward()
    assert grads_finite([w, b])
    w.grad[0] = math.nan
    assert not grads_finite([w, b])


def test_skips_and_resets_then_stops_after_n_in_a_row(tmp_path):
    guard = NonFiniteGuard(3)
    assert guard.check({"policy_loss": 0.5, "grad_norm_actor": torch.tensor(1.0)})
    assert not guard.check({"policy_loss": math.nan, "grad_norm_actor": 1.0})
    assert not guard.check({"policy_loss": 0.1, "grad_norm_actor": math.inf})
    assert guard.check({"policy_loss": 0.1, "grad_norm_actor": 1.0})  # a good step resets the run
    assert (guard.in_row, guard.skipped_total) == (0, 2)
    guard.last_checkpoint = tmp_path / "checkpoints" / "iter_000004"
    assert not guard.check({"value_loss": math.nan})
    assert not guard.check({"value_loss": math.nan})
    with pytest.raises(NonFiniteError) as info:
        guard.check({"value_loss": math.inf})
    message = str(info.value)
    assert isinstance(info.value, UserError) and info.value.exit_code == 1
    assert "3 optimizer steps in a row had a non-finite value_loss" in message
    assert "iter_000004" in message and "--resume" in message and "\n" not in message
    restored = NonFiniteGuard(3)
    restored.load_state_dict(guard.state_dict())
    assert restored.skipped_total == 5

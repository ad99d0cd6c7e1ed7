"""Importance-sampling correction: truncated weights, the weighted policy loss and the mismatch
metrics, against numbers derived by hand."""

from __future__ import annotations

import math

import pytest
import torch

from homerlhf.ppo.importance import importance_metrics, truncated_importance_weights, weighted_policy_loss
from homerlhf.ppo.math import policy_loss

LN2 = math.log(2.0)


def test_truncated_weights_by_hand():
    # old - behaviour per token: ln 0.5, 0, ln 3 (capped at 2), padding (garbage, never read).
    old = torch.tensor([[-1.0 - LN2, -0.5, -2.0 + math.log(3.0), float("nan")]])
    behaviour = torch.tensor([[-1.0, -0.5, -2.0, float("inf")]])
    mask = torch.tensor([[1, 1, 1, 0]])
    w = truncated_importance_weights(old, behaviour, mask, cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[0.5, 1.0, 2.0, 0.0]]), atol=1e-6, rtol=0)
    # Off: every response token weighs 1, padding 0.
    assert truncated_importance_weights(old, behaviour, mask, cap=None).tolist() == [[1.0, 1.0, 1.0, 0.0]]


def test_weighted_policy_loss_by_hand():
    """Two tokens, eps = 0.2, weights 0.5 and 2.
    Token 1: A = 1, ratio = e^0.1 = 1.10517 (inside the clip): term = max(-1.10517, -1.10517) = -1.10517; x 0.5 = -0.552585.
    Token 2: A = -1, ratio = e^0.3 = 1.34986 (clipped to 1.2): max(1.34986, 1.2) = 1.34986; x 2 = 2.69972.
    Padding: nan everywhere, must not matter. Loss = (-0.552585 + 2.69972) / 2 = 1.073567."""
    nan = float("nan")
    logprobs = torch.tensor([[-1.0 + 0.1, -2.0 + 0.3, nan]], requires_grad=True)
    old = torch.tensor([[-1.0, -2.0, nan]])
    advantages = torch.tensor([[1.0, -1.0, nan]])
    weights = torch.tensor([[0.5, 2.0, nan]])
    mask = torch.tensor([[1, 1, 0]])
    loss, clipfrac, approx_kl = weighted_policy_loss(logprobs, old, advantages, weights, mask, clip_range=0.2)
    expected = (-0.5 * math.exp(0.1) + 2.0 * math.exp(0.3)) / 2
    assert float(loss.detach()) == pytest.approx(expected, abs=1e-6)
    # Token 2's unclipped term is the larger: no token has the clipped term strictly larger.
    assert float(clipfrac) == 0.0
    # approx_kl is the unweighted one: mean of (r - 1) - log r.
    k3 = ((math.exp(0.1) - 1 - 0.1) + (math.exp(0.3) - 1 - 0.3)) / 2
    assert float(approx_kl) == pytest.approx(k3, abs=1e-6)
    loss.backward()
    # d loss / d logp_t = w_t * (-A_t * r_t) / 2 on both (no clipping active), 0 on padding.
    grad = logprobs.grad.tolist()[0]
    assert grad[0] == pytest.approx(0.5 * -math.exp(0.1) / 2, abs=1e-6)
    assert grad[1] == pytest.approx(2.0 * math.exp(0.3) / 2, abs=1e-6)
    assert grad[2] == 0.0


def test_unit_weights_give_the_plain_policy_loss():
    torch.manual_seed(0)
    logprobs, old, adv = torch.randn(3, 5), torch.randn(3, 5), torch.randn(3, 5)
    mask = torch.ones(3, 5)
    mask[1, 3:] = 0
    plain = policy_loss(logprobs, old, adv, mask, 0.2)
    for weights in (None, mask.clone()):
        assert [float(x) for x in weighted_policy_loss(logprobs, old, adv, weights, mask, 0.2)] == \
            [float(x) for x in plain]


def test_importance_metrics_by_hand():
    # Ratios old/behaviour: 0.5, 1, 3 (capped to 2); padding garbage.
    old = torch.tensor([[-1.0 - LN2, -0.5, -2.0 + math.log(3.0), 7.0]])
    behaviour = torch.tensor([[-1.0, -0.5, -2.0, float("nan")]])
    mask = torch.tensor([[True, True, True, False]])
    w = truncated_importance_weights(old, behaviour, mask, cap=2.0)
    stats = {k: float(v) for k, v in importance_metrics(old, behaviour, w, mask).items()}
    assert stats["is_weight_mean"] == pytest.approx((0.5 + 1 + 2) / 3, abs=1e-6)
    assert stats["is_weight_max"] == pytest.approx(2.0, abs=1e-6)
    assert stats["is_capped_fraction"] == pytest.approx(1 / 3, abs=1e-6)
    # k3 with r = 0.5, 1, 3: (r - 1) - ln r = 0.193147, 0, 0.901388.
    k3 = ((0.5 - 1 + LN2) + 0.0 + (3 - 1 - math.log(3.0))) / 3
    assert stats["kl_behaviour_old"] == pytest.approx(k3, abs=1e-6)


def test_identical_logprobs_give_exactly_one_zero_zero():
    old = torch.tensor([[-0.123456, -3.3, -1e-7]])
    mask = torch.ones(1, 3)
    w = truncated_importance_weights(old, old.clone(), mask, cap=2.0)
    stats = {k: float(v) for k, v in importance_metrics(old, old.clone(), w, mask).items()}
    assert stats == {"is_weight_mean": 1.0, "is_weight_max": 1.0, "is_capped_fraction": 0.0, "kl_behaviour_old": 0.0}


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="behaviour_logprobs has shape"):
        truncated_importance_weights(torch.zeros(2, 3), torch.zeros(2), torch.ones(2, 3), 2.0)

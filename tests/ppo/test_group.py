"""GRPO/RLOO math against hand-derived numbers."""

import math

import pytest
import torch

from homerlhf.ppo.group import (
    GroupLoss, aggregate, clipped_group_loss, group_zero_spread, grpo_advantages, rloo_advantages, token_advantages,
)
from homerlhf.ppo.math import k3_kl

ATOL = 1e-6


def test_grpo_advantages_by_hand():
    rewards = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 5.0, 5.0, 5.0])
    std = math.sqrt((1.5**2 * 2 + 0.5**2 * 2) / 3)  # unbiased std of 1..4 = 1.2909944
    expected = [-1.5 / (std + 1e-4), -0.5 / (std + 1e-4), 0.5 / (std + 1e-4), 1.5 / (std + 1e-4), 0, 0, 0, 0]
    torch.testing.assert_close(grpo_advantages(rewards, 4), torch.tensor(expected), atol=ATOL, rtol=0)


def test_dr_grpo_advantages_do_not_scale():
    rewards = torch.tensor([0.0, 1.0, 10.0, 30.0])
    torch.testing.assert_close(grpo_advantages(rewards, 2, scale_std=False), torch.tensor([-0.5, 0.5, -10.0, 10.0]),
                               atol=ATOL, rtol=0)


def test_rloo_leave_one_out_by_hand():
    rewards = torch.tensor([1.0, 2.0, 3.0, 4.0, 0.0, 6.0])
    # Group 1: 1 - (2+3+4)/3 = -2, 2 - 8/3, 3 - 7/3, 4 - 2; group 2 of two: 0 - 6, 6 - 0.
    expected = torch.tensor([-2.0, -2.0 / 3, 2.0 / 3, 2.0, -6.0, 6.0])
    torch.testing.assert_close(rloo_advantages(rewards[:4], 4), expected[:4], atol=ATOL, rtol=0)
    torch.testing.assert_close(rloo_advantages(rewards[4:], 2), expected[4:], atol=ATOL, rtol=0)


def test_groups_must_be_whole():
    with pytest.raises(ValueError, match="multiple of 4"):
        grpo_advantages(torch.zeros(6), 4)
    with pytest.raises(ValueError, match=">= 2"):
        rloo_advantages(torch.zeros(4), 1)


def test_zero_spread_fraction():
    assert float(group_zero_spread(torch.tensor([1.0, 1.0, 0.0, 1.0, 2.0, 2.0]), 2)) == pytest.approx(2 / 3)


def test_token_advantages_ragged_with_padding():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    out = token_advantages(torch.tensor([2.0, -1.0]), mask)
    torch.testing.assert_close(out, torch.tensor([[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]]), atol=ATOL, rtol=0)


def test_k3_kl_by_hand_and_padding_ignored():
    logp = torch.tensor([[math.log(0.5), float("nan")]])
    ref = torch.tensor([[math.log(0.25), float("inf")]])
    mask = torch.tensor([[1, 0]])
    # ref - logp = log 0.5: 0.5 - 1 - log 0.5 = 0.1931472
    kl, clamped = k3_kl(logp, ref, mask)
    torch.testing.assert_close(kl, torch.tensor([[0.5 - 1 - math.log(0.5), 0.0]]), atol=ATOL, rtol=0)
    assert clamped.tolist() == [[False, False]]


@pytest.mark.parametrize("mode,expected", [("token_mean", 7 / 3), ("seq_mean_token_mean", 2.75), ("constant", 0.875)])
def test_aggregations_by_hand(mode, expected):
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert float(aggregate(per_token, mask, mode, max_len=4)) == pytest.approx(expected, abs=ATOL)


def test_clipped_group_loss_values_and_stats():
    logp = torch.tensor([[math.log(1.5)], [math.log(0.5)]])
    old = torch.zeros(2, 1)
    mask = torch.ones(2, 1)
    # Row 1: A=+1, ratio 1.5 -> max(-1.5, -1.2) = -1.2; row 2: A=-1, ratio 0.5 -> max(0.5, 0.8) = 0.8.
    loss, stats = clipped_group_loss(logp, old, logp.clone(), torch.tensor([1.0, -1.0]), mask,
                                     GroupLoss(0.2, 0.1, "token_mean"))
    assert float(loss) == pytest.approx(-0.2, abs=ATOL)
    assert float(stats["clipfrac"]) == pytest.approx(1.0)
    assert float(stats["kl_ref"]) == pytest.approx(0.0, abs=ATOL)
    # approx_kl: (1.5 - 1 - log 1.5 + 0.5 - 1 - log 0.5) / 2
    assert float(stats["approx_kl"]) == pytest.approx((0.5 - math.log(1.5) - 0.5 - math.log(0.5)) / 2, abs=ATOL)


def test_clipped_group_loss_gradient_with_kl_in_loss():
    # Ratio 1 (unclipped), A = 2: d/dlogp of -A * ratio = -2. The k3 term with ref - logp = log 0.5:
    # d/dlogp [exp(ref - logp) - (ref - logp) - 1] = -0.5 + 1 = 0.5, times kl_coef 0.1 -> 0.05.
    logp = torch.tensor([[math.log(0.5)]], requires_grad=True)
    loss, stats = clipped_group_loss(logp, logp.detach().clone(), torch.tensor([[math.log(0.25)]]),
                                     torch.tensor([2.0]), torch.ones(1, 1), GroupLoss(0.2, 0.1, "seq_mean_token_mean"))
    loss.backward()
    assert float(logp.grad) == pytest.approx(-2.0 + 0.05, abs=ATOL)
    assert float(loss) == pytest.approx(-2.0 + 0.1 * (0.5 - 1 - math.log(0.5)), abs=ATOL)
    assert float(stats["kl_ref"]) == pytest.approx(0.5 - 1 - math.log(0.5), abs=ATOL)


def test_clipped_group_loss_kl_is_bounded_and_gives_no_gradient_on_capped_tokens():
    # One row, A = 1, old = logp (ratio 1, unclipped): the ratio term is -1 per token, gradient -1.
    # d = ref - logp = [0.5, -30, 100] (+ a padded token of garbage). k3 (detail: homerlhf.ppo.math.k3_kl):
    #   d = 0.5: e^0.5 - 1.5 = 0.1487212707, gradient 1 - e^0.5 = -0.6487212707;
    #   d = -30 -> -20 -> 19.000000002 -> capped to 10, gradient 0;
    #   d = 100 -> 20 -> capped to 10, gradient 0 (exp(100) would be inf in float32: 0 * inf = nan).
    # token_mean over the 3 response tokens, kl_coef 0.1:
    #   loss = (-3 + 0.1 * (0.1487212707 + 10 + 10)) / 3 = -0.3283759576
    #   grad = [(-1 + 0.1 * -0.6487212707) / 3, -1 / 3, -1 / 3, 0] = [-0.3549573757, -0.3333333333, ...]
    # The capped tokens keep the ratio term's gradient; only the KL term stops pulling on them.
    logp = torch.tensor([[0.0, 0.0, 0.0, float("nan")]], requires_grad=True)
    ref = torch.tensor([[0.5, -30.0, 100.0, float("inf")]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, stats = clipped_group_loss(logp, torch.zeros(1, 4), ref, torch.tensor([1.0]), mask,
                                     GroupLoss(0.2, 0.1, "token_mean"))
    loss.backward()
    assert float(loss.detach()) == pytest.approx(-0.3283759576, abs=ATOL)
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.3549573757, -1 / 3, -1 / 3, 0.0]]), atol=ATOL, rtol=0)
    assert float(stats["kl_clamped"]) == pytest.approx(2 / 3, abs=ATOL)
    assert float(stats["kl_ref"]) == pytest.approx(20.1487212707 / 3, abs=ATOL)


def test_constant_aggregation_has_no_length_bias():
    # Same per-token loss, one response twice as long: token_mean weighs tokens, constant divides by B * max_len.
    per_token = torch.ones(2, 4)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    assert float(aggregate(per_token, mask, "constant", max_len=4)) == pytest.approx(6 / 8)
    assert float(aggregate(per_token, mask, "seq_mean_token_mean")) == pytest.approx(1.0)


def test_importance_weights_scale_each_tokens_clipped_term():
    # Two tokens, ratio 1, A = 1: per-token loss -1 each; weights 2 and 0.5 -> (-2 - 0.5) / 2 = -1.25.
    logp = torch.zeros(1, 2)
    loss, stats = clipped_group_loss(logp, logp.clone(), logp.clone(), torch.tensor([1.0]), torch.ones(1, 2),
                                     GroupLoss(0.2, 0.0, "token_mean"),
                                     torch.tensor([[2.0, 0.5]]))
    assert float(loss) == pytest.approx(-1.25, abs=ATOL)
    assert float(stats["clipfrac"]) == 0.0

"""homerlhf.ppo.math against numbers derived by hand (derivations in the comments), GAE against a
naive per-row loop, and padding invariance for every function that takes a mask.

Hand-number tests run in float64 so that atol=1e-6 checks the math rather than float32 rounding.
"""

from __future__ import annotations

import math

import pytest
import torch

from homerlhf.ppo.math import (
    K3_LOG_RATIO_BOUND,
    K3_MAX,
    explained_variance,
    gae,
    k3_kl,
    kl_penalized_rewards,
    masked_mean,
    masked_var,
    masked_whiten,
    policy_loss,
    truncation_penalized_scores,
    value_loss,
)

F64 = torch.float64
ATOL = 1e-6

# The B=2, T=3 layout used throughout: row 0 has 3 response tokens, row 1 has 2 and one pad.
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=F64)
PAD = MASK == 0


def t(rows, dtype=F64):
    return torch.tensor(rows, dtype=dtype)


def close(actual, expected, atol=ATOL):
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0)


def with_padding(x: torch.Tensor, fill: float) -> torch.Tensor:
    """``x`` with ``fill`` written at the padded position of MASK."""
    return torch.where(PAD, torch.full_like(x, fill), x)


# ---------------------------------------------------------------- masked statistics

# A mask keeping the 4 values 1, 2, 3, 4 gives round numbers; 50 and -70 are padding.
X4 = t([[1.0, 2.0, 3.0], [4.0, 50.0, -70.0]])
MASK4 = t([[1, 1, 1], [1, 0, 0]])


def test_masked_mean_by_hand():
    # all: (1 + 2 + 3 + 4) / 4 = 2.5
    close(masked_mean(X4, MASK4), 2.5)
    # dim=1: row 0 (1+2+3)/3 = 2; row 1 4/1 = 4
    close(masked_mean(X4, MASK4, dim=1), [2.0, 4.0])
    # dim=0: column 0 (1+4)/2 = 2.5; column 1 2/1 = 2; column 2 3/1 = 3
    close(masked_mean(X4, MASK4, dim=0), [2.5, 2.0, 3.0])


def test_masked_mean_bool_and_float_masks_agree():
    close(masked_mean(X4, MASK4.bool()), masked_mean(X4, MASK4))
    close(masked_mean(X4, MASK4.bool(), dim=1), masked_mean(X4, MASK4, dim=1))


def test_masked_var_by_hand():
    # values 1, 2, 3, 4; mean 2.5; squared deviations 2.25 + 0.25 + 0.25 + 2.25 = 5
    # biased 5 / 4 = 1.25; unbiased 5 / 3 = 1.6666667
    close(masked_var(X4, MASK4, unbiased=False), 1.25)
    close(masked_var(X4, MASK4, unbiased=True), 5.0 / 3.0)
    close(masked_var(X4, MASK4), 5.0 / 3.0)  # unbiased is the default


def test_masked_var_single_value_and_empty_mask():
    one = t([[0, 0, 1], [0, 0, 0]])
    # one value: no spread, and the unbiased estimate is defined as 0 instead of nan
    close(masked_var(X4, one, unbiased=True), 0.0)
    close(masked_var(X4, one, unbiased=False), 0.0)
    with pytest.raises(ValueError, match="no elements"):
        masked_var(X4, torch.zeros_like(MASK4))


def test_masked_whiten_by_hand():
    # mean 2.5, unbiased var 5/3, so 1/std = sqrt(3/5) = 0.7745967 (eps = 1e-8 moves it < 1e-8)
    # (1 - 2.5) * 0.7745967 = -1.1618950; (2 - 2.5) * 0.7745967 = -0.3872983; and symmetric
    close(
        masked_whiten(X4, MASK4),
        [[-1.1618950, -0.3872983, 0.3872983], [1.1618950, 0.0, 0.0]],
    )
    # shift_mean=False adds the mean 2.5 back: 1.3381050, 2.1127017, 2.8872983, 3.6618950
    close(
        masked_whiten(X4, MASK4, shift_mean=False),
        [[1.3381050, 2.1127017, 2.8872983], [3.6618950, 0.0, 0.0]],
    )


def test_masked_whiten_gives_zero_mean_unit_variance():
    x = torch.randn(4, 7, dtype=F64, generator=torch.Generator().manual_seed(0)) * 3 + 5
    mask = torch.ones(4, 7, dtype=torch.bool)
    mask[1, 4:] = False
    mask[3, 2:] = False
    w = masked_whiten(x, mask)
    close(masked_mean(w, mask), 0.0)
    close(masked_var(w, mask), 1.0)
    assert (w[~mask] == 0).all()


# ---------------------------------------------------------------- KL-penalised rewards

LOGPROBS = t([[-1.0, -2.0, -0.5], [-0.3, -1.2, 0.0]])
REF_LOGPROBS = t([[-1.5, -1.0, -0.5], [-0.1, -1.0, 0.0]])
SCORES = t([2.0, -1.0])
KL_COEF = 0.1


def test_kl_penalized_rewards_k1_by_hand():
    # kl = logp - ref_logp: row 0 [0.5, -1.0, 0.0]; row 1 [-0.2, -0.2, pad 0]
    # rewards = -0.1 * kl, + score on the last response token:
    #   row 0 [-0.05, 0.1, 0.0 + 2.0];  row 1 [0.02, 0.02 - 1.0, 0] = [0.02, -0.98, 0]
    rewards, kl = kl_penalized_rewards(SCORES, LOGPROBS, REF_LOGPROBS, MASK, KL_COEF, "k1")
    close(kl, [[0.5, -1.0, 0.0], [-0.2, -0.2, 0.0]])
    close(rewards, [[-0.05, 0.1, 2.0], [0.02, -0.98, 0.0]])


def test_kl_penalized_rewards_k3_by_hand():
    # d = ref_logp - logp: row 0 [-0.5, 1.0, 0.0]; row 1 [0.2, 0.2]
    # k3 = e^d - 1 - d:
    #   e^-0.5 = 0.6065306597 -> 0.6065306597 - 1 + 0.5 = 0.1065306597
    #   e^1    = 2.7182818285 -> 2.7182818285 - 1 - 1   = 0.7182818285
    #   e^0    = 1            -> 0
    #   e^0.2  = 1.2214027582 -> 1.2214027582 - 1 - 0.2 = 0.0214027582
    # rewards = -0.1 * k3 (+ score at the end):
    #   row 0 [-0.0106530660, -0.0718281828, 2.0]; row 1 [-0.0021402758, -1.0021402758, 0]
    rewards, kl = kl_penalized_rewards(SCORES, LOGPROBS, REF_LOGPROBS, MASK, KL_COEF, "k3")
    close(kl, [[0.1065306597, 0.7182818285, 0.0], [0.0214027582, 0.0214027582, 0.0]])
    close(rewards, [[-0.0106530660, -0.0718281828, 2.0], [-0.0021402758, -1.0021402758, 0.0]])


# ---------------------------------------------------------------- bounded k3

# d = ref_logp - logp per token (logp = 0, so ref_logp = d); row 1's last token is padding.
K3_D = t([[0.5, 20.0, 25.0, 2.0], [-30.0, -20.0, -1.0, 0.0]])
K3_MASK = t([[1, 1, 1, 1], [1, 1, 1, 0]])


def test_k3_kl_by_hand_inside_at_and_beyond_the_bounds():
    assert (K3_LOG_RATIO_BOUND, K3_MAX) == (20.0, 10.0)  # verl's bounds; the numbers below assume them
    # k3 = e^d - 1 - d, then at most 10:
    #   d = 0.5: e^0.5 = 1.6487212707 -> 1.6487212707 - 1.5 = 0.1487212707 (kept)
    #   d = 20 (the bound itself): e^20 - 21 = 485165174.4 -> capped to 10
    #   d = 25 -> clamped to 20 -> as above -> 10
    #   d = 2: e^2 - 3 = 7.3890560989 - 3 = 4.3890560989 (kept: the cap binds only past d ~ 2.61)
    #   d = -30 -> clamped to -20 -> e^-20 - 1 + 20 = 19.000000002 -> capped to 10
    #   d = -20 (the bound itself): 19.000000002 -> 10
    #   d = -1: e^-1 - 1 + 1 = 0.3678794412 (kept)
    kl, clamped = k3_kl(torch.zeros_like(K3_D), K3_D, K3_MASK)
    close(kl, [[0.1487212707, 10.0, 10.0, 4.3890560989], [10.0, 10.0, 0.3678794412, 0.0]], atol=1e-9)
    assert clamped.tolist() == [[False, True, True, False], [True, True, False, False]]
    # The clamped fraction counts response tokens only: 4 of the 7 (the padded d = 0 is not one).
    assert float(masked_mean(clamped.to(F64), K3_MASK)) == pytest.approx(4 / 7, abs=1e-12)


def test_k3_kl_is_the_unbounded_k3_bit_for_bit_inside_the_bounds():
    # Ordinary values (|d| < 2.6, where no cap binds): the value and the gradient are the old formula's.
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, F64):
        logp = (-torch.rand(4, 6, generator=g, dtype=dtype) * 3).requires_grad_(True)
        ref = logp.detach() + (torch.rand(4, 6, generator=g, dtype=dtype) * 5 - 2.5)
        mask = torch.ones(4, 6, dtype=dtype)
        kl, clamped = k3_kl(logp, ref, mask)
        (kl_grad,) = torch.autograd.grad(kl.sum(), logp)
        d = ref - logp
        old = torch.expm1(d) - d
        (old_grad,) = torch.autograd.grad(old.sum(), logp)
        torch.testing.assert_close(kl, old, atol=0, rtol=0)
        torch.testing.assert_close(kl_grad, old_grad, atol=0, rtol=0)
        assert not clamped.any()


def test_k3_kl_gradient_by_hand_and_zero_on_clamped_tokens():
    # d(k3)/d(logp) = d(e^d - 1 - d)/dd * dd/dlogp = (e^d - 1) * (-1) = 1 - e^d.
    #   d = 0.5: 1 - 1.6487212707 = -0.6487212707;  d = 2: 1 - 7.3890560989 = -6.3890560989;
    #   d = -1: 1 - 0.3678794412 = 0.6321205588; capped tokens (and padding): 0.
    logp = torch.zeros_like(K3_D).requires_grad_(True)
    kl, _ = k3_kl(logp, K3_D, K3_MASK)
    kl.sum().backward()
    close(logp.grad, [[-0.6487212707, 0.0, 0.0, -6.3890560989], [0.0, 0.0, 0.6321205588, 0.0]], atol=1e-9)


def test_k3_kl_log_ratio_bound_keeps_the_capped_gradient_finite():
    # float32 exp overflows past d ~ 88.7: without the bound on d, a capped token's zero gradient
    # would meet exp(d) = inf in backward (0 * inf = nan). With it, d = 100 and 1e4 give 0 exactly.
    logp = torch.zeros(1, 3, requires_grad=True)
    kl, clamped = k3_kl(logp, torch.tensor([[100.0, 1e4, -1e4]]), torch.ones(1, 3))
    kl.sum().backward()
    assert kl.tolist() == [[K3_MAX] * 3] and clamped.all()
    assert logp.grad.tolist() == [[0.0, 0.0, 0.0]]


def test_k3_kl_padding_garbage_never_reaches_the_result():
    # inf/nan at the padded position, in either input: the same kl, mask and gradients as clean zeros.
    for fill in (math.inf, -math.inf, math.nan):
        logp = torch.where(K3_MASK == 0, torch.full_like(K3_D, fill), torch.zeros_like(K3_D)).requires_grad_(True)
        ref = torch.where(K3_MASK == 0, torch.full_like(K3_D, -fill), K3_D)
        kl, clamped = k3_kl(logp, ref, K3_MASK)
        kl.sum().backward()
        clean_kl, clean_clamped = k3_kl(torch.zeros_like(K3_D), K3_D, K3_MASK)
        torch.testing.assert_close(kl, clean_kl, atol=0, rtol=0)
        assert torch.equal(clamped, clean_clamped) and not clamped[1, 3]
        assert torch.isfinite(logp.grad).all() and logp.grad[1, 3] == 0


def test_kl_penalized_rewards_k3_is_bounded():
    # The reward's k3 is k3_kl's: d = [0.5, 25] -> kl [0.1487212707, 10];
    # rewards = -0.1 * kl + score 2 on the last token = [-0.0148721271, -1.0 + 2.0].
    logp = t([[0.0, 0.0]])
    rewards, kl = kl_penalized_rewards(t([2.0]), logp, t([[0.5, 25.0]]), t([[1, 1]]), 0.1, "k3")
    close(kl, [[0.1487212707, 10.0]], atol=1e-9)
    close(rewards, [[-0.0148721271, 1.0]], atol=1e-9)


def test_kl_penalized_rewards_score_goes_to_last_mask_position():
    # Row 0: an offset block [0, 1, 1] gets its score at index 2; row 1: a block of one token
    # at index 0. No KL (logp == ref), so rewards are the scores alone.
    mask = t([[0, 1, 1], [1, 0, 0]])
    lp = torch.zeros(2, 3, dtype=F64)
    rewards, kl = kl_penalized_rewards(t([3.0, 4.0]), lp, lp, mask, 0.5)
    close(rewards, [[0.0, 0.0, 3.0], [4.0, 0.0, 0.0]])
    close(kl, torch.zeros(2, 3))
    # An empty row gets no score at all.
    rewards, _ = kl_penalized_rewards(t([3.0, 4.0]), lp, lp, t([[1, 1, 0], [0, 0, 0]]), 0.5)
    close(rewards, [[0.0, 3.0, 0.0], [0.0, 0.0, 0.0]])


def test_kl_penalized_rewards_rejects_bad_input():
    with pytest.raises(ValueError, match="estimator"):
        kl_penalized_rewards(SCORES, LOGPROBS, REF_LOGPROBS, MASK, KL_COEF, "k2")
    with pytest.raises(ValueError, match="scores"):
        kl_penalized_rewards(SCORES[:1], LOGPROBS, REF_LOGPROBS, MASK, KL_COEF)
    with pytest.raises(ValueError, match="mask"):
        kl_penalized_rewards(SCORES, LOGPROBS, REF_LOGPROBS, MASK[:, :2], KL_COEF)


# ---------------------------------------------------------------- GAE


def test_gae_by_hand():
    # gamma = 0.9, lam = 0.8, gamma * lam = 0.72; V after the last response token is 0.
    # Row 0: r = [1, 0, 2], V = [0.5, 1.0, 1.5]
    #   t=2: delta = 2 + 0.9*0 - 1.5 = 0.5;        A2 = 0.5
    #   t=1: delta = 0 + 0.9*1.5 - 1.0 = 0.35;     A1 = 0.35 + 0.72*0.5 = 0.71
    #   t=0: delta = 1 + 0.9*1.0 - 0.5 = 1.4;      A0 = 1.4 + 0.72*0.71 = 1.9112
    #   returns = A + V = [2.4112, 1.71, 2.0]
    # Row 1: r = [0.5, -1], V = [2.0, 1.0], pad
    #   t=1: delta = -1 + 0 - 1.0 = -2.0;          A1 = -2.0
    #   t=0: delta = 0.5 + 0.9*1.0 - 2.0 = -0.6;   A0 = -0.6 + 0.72*(-2.0) = -2.04
    #   returns = [-0.04, -1.0, 0]
    rewards = t([[1.0, 0.0, 2.0], [0.5, -1.0, 0.0]])
    values = t([[0.5, 1.0, 1.5], [2.0, 1.0, 0.0]])
    advantages, returns = gae(rewards, values, MASK, gamma=0.9, lam=0.8)
    close(advantages, [[1.9112, 0.71, 0.5], [-2.04, -2.0, 0.0]])
    close(returns, [[2.4112, 1.71, 2.0], [-0.04, -1.0, 0.0]])


def naive_gae(rewards, values, mask, gamma, lam):
    """Independent reference: per row, A_t = sum_l (gamma*lam)^l delta_{t+l} over the row's
    response block, in plain Python floats (O(T^2))."""
    B, T = len(rewards), len(rewards[0])
    adv = [[0.0] * T for _ in range(B)]
    ret = [[0.0] * T for _ in range(B)]
    for b in range(B):
        idx = [i for i in range(T) if mask[b][i]]
        r = [float(rewards[b][i]) for i in idx]
        v = [float(values[b][i]) for i in idx] + [0.0]
        deltas = [r[k] + gamma * v[k + 1] - v[k] for k in range(len(idx))]
        for k, i in enumerate(idx):
            a = sum((gamma * lam) ** l * deltas[k + l] for l in range(len(idx) - k))
            adv[b][i] = a
            ret[b][i] = a + v[k]
    return torch.tensor(adv, dtype=F64), torch.tensor(ret, dtype=F64)


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.99, 0.9), (0.5, 1.0), (1.0, 0.0)])
def test_gae_matches_naive_loop_on_ragged_batches(gamma, lam):
    g = torch.Generator().manual_seed(1234)
    B, T = 6, 9
    rewards = torch.randn(B, T, dtype=F64, generator=g)
    values = torch.randn(B, T, dtype=F64, generator=g)
    lengths = [9, 1, 4, 0, 7, 2]  # ragged, including an empty row and a full row
    mask = torch.tensor([[i < n for i in range(T)] for n in lengths])
    advantages, returns = gae(rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = naive_gae(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam)
    close(advantages, ref_adv)
    close(returns, ref_ret)


def test_gae_gamma_lam_one_is_reward_to_go_minus_value():
    # With gamma = lam = 1 the advantage telescopes to (sum_{k>=t} r_k) - V_t.
    rewards = t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    values = t([[0.5, 0.25, 0.125], [1.0, 2.0, 3.0]])
    advantages, returns = gae(rewards, values, MASK, 1.0, 1.0)
    # row 0 reward-to-go [6, 5, 3]; row 1 [9, 5]
    close(returns, [[6.0, 5.0, 3.0], [9.0, 5.0, 0.0]])
    close(advantages, [[5.5, 4.75, 2.875], [8.0, 3.0, 0.0]])


# ---------------------------------------------------------------- policy loss

# Ratios r = [[1.0, 1.5, 0.5], [1.1, 0.7, pad]], clip 0.2 -> clip(r) in [0.8, 1.2]
RATIOS = t([[1.0, 1.5, 0.5], [1.1, 0.7, 1.0]])
OLD_LOGPROBS = t([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]])
NEW_LOGPROBS = OLD_LOGPROBS + RATIOS.log()
ADVANTAGES = t([[1.0, 2.0, -1.0], [-2.0, 0.5, 0.0]])


def test_policy_loss_by_hand():
    # token  r    A     -A*r    -A*clip(r)        max     clipped strictly larger?
    # (0,0)  1.0  1.0   -1.0    -1.0*1.0 = -1.0    -1.0    no (equal)
    # (0,1)  1.5  2.0   -3.0    -2.0*1.2 = -2.4    -2.4    yes
    # (0,2)  0.5 -1.0    0.5     1.0*0.8 =  0.8     0.8    yes
    # (1,0)  1.1 -2.0    2.2     2.0*1.1 =  2.2     2.2    no (equal, r inside the clip range)
    # (1,1)  0.7  0.5   -0.35   -0.5*0.8 = -0.4    -0.35   no
    # loss = (-1.0 - 2.4 + 0.8 + 2.2 - 0.35) / 5 = -0.75 / 5 = -0.15; clipfrac = 2 / 5 = 0.4
    # approx_kl = mean of (r - 1) - ln r:
    #   r=1.0: 0;  r=1.5: 0.5 - 0.4054651081 = 0.0945348919;  r=0.5: -0.5 + 0.6931471806 = 0.1931471806
    #   r=1.1: 0.1 - 0.0953101798 = 0.0046898202;  r=0.7: -0.3 + 0.3566749439 = 0.0566749439
    #   sum = 0.3490468366; / 5 = 0.0698093673
    loss, clipfrac, approx_kl = policy_loss(NEW_LOGPROBS, OLD_LOGPROBS, ADVANTAGES, MASK, 0.2)
    close(loss, -0.15)
    close(clipfrac, 0.4)
    close(approx_kl, 0.0698093673)


def test_policy_loss_gradient_by_hand():
    # d(-A r)/d logp = -A r on tokens where the unclipped term is the max; 0 where the clipped
    # (constant) term wins; 0 on padding; everything / 5 tokens:
    #   (0,0): -1*1.0/5 = -0.2   (0,1): 0   (0,2): 0   (1,0): 2*1.1/5 = 0.44   (1,1): -0.5*0.7/5 = -0.07
    # At (1,0) the two terms tie; both have the same gradient there, so the split does not matter.
    logprobs = NEW_LOGPROBS.clone().requires_grad_(True)
    loss, _, _ = policy_loss(logprobs, OLD_LOGPROBS, ADVANTAGES, MASK, 0.2)
    loss.backward()
    close(logprobs.grad, [[-0.2, 0.0, 0.0], [0.44, -0.07, 0.0]])


def test_policy_loss_at_old_policy():
    # r = 1 everywhere: loss = -masked_mean(A) = -(1 + 2 - 1 - 2 + 0.5) / 5 = -0.1, nothing clipped
    loss, clipfrac, approx_kl = policy_loss(OLD_LOGPROBS, OLD_LOGPROBS, ADVANTAGES, MASK, 0.2)
    close(loss, -0.1)
    close(clipfrac, 0.0)
    close(approx_kl, 0.0)


# ---------------------------------------------------------------- value loss


def test_value_loss_by_hand():
    # clip 0.2: V_clip = old + clip(V - old, -0.2, 0.2)
    # token  V     old   R     (V-R)^2   V_clip  (V_clip-R)^2   max    clipped larger?
    # (0,0)  1.0   1.0   2.0   1.0       1.0     1.0            1.0    no (equal)
    # (0,1)  1.5   1.0   2.0   0.25      1.2     0.64           0.64   yes
    # (0,2)  0.5   1.0   0.0   0.25      0.8     0.64           0.64   yes
    # (1,0) -1.0   0.0  -2.0   1.0      -0.2     3.24           3.24   yes
    # (1,1)  1.5   1.0   1.0   0.25      1.2     0.04           0.25   no
    # loss = 0.5 * (1 + 0.64 + 0.64 + 3.24 + 0.25) / 5 = 0.5 * 5.77 / 5 = 0.577; clipfrac = 3/5
    values = t([[1.0, 1.5, 0.5], [-1.0, 1.5, 0.0]])
    old_values = t([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    returns = t([[2.0, 2.0, 0.0], [-2.0, 1.0, 0.0]])
    loss, clipfrac = value_loss(values, old_values, returns, MASK, 0.2)
    close(loss, 0.577)
    close(clipfrac, 0.6)
    # gradient: d/dV 0.5*(V-R)^2/5 = (V-R)/5 on the unclipped winner (0,0) and (1,1); the
    # clipped winners are constant in V (V - old is outside the clip range): (0,0) -1/5, (1,1) 0.5/5
    v = values.clone().requires_grad_(True)
    value_loss(v, old_values, returns, MASK, 0.2)[0].backward()
    close(v.grad, [[-0.2, 0.0, 0.0], [0.0, 0.1, 0.0]])


# ---------------------------------------------------------------- explained variance


def test_explained_variance_by_hand():
    # R over the 4 unmasked positions of MASK4 = [1, 2, 3, 4]; V = [1.5, 1.5, 3.5, 3.5]
    # R - V = [-0.5, 0.5, -0.5, 0.5]: biased var 0.25; Var[R] biased 1.25 -> 1 - 0.25/1.25 = 0.8
    returns = X4
    values = t([[1.5, 1.5, 3.5], [3.5, -9.0, 9.0]])
    close(explained_variance(values, returns, MASK4), 0.8)
    close(explained_variance(returns, returns, MASK4), 1.0)  # perfect critic
    # A constant critic at the mean explains nothing: Var[R - 2.5] = Var[R] -> 0
    close(explained_variance(torch.full_like(returns, 2.5), returns, MASK4), 0.0)


def test_explained_variance_is_zero_when_returns_are_constant():
    returns = torch.full((2, 3), 7.0, dtype=F64)
    ev = explained_variance(t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]), returns, MASK)
    assert ev.dtype == F64 and not torch.isnan(ev)
    close(ev, 0.0)


def test_truncation_penalized_scores_by_hand():
    scores = t([1.0, 2.0, 3.0])
    truncated = torch.tensor([False, True, False])
    close(truncation_penalized_scores(scores, truncated, -1.0), [1.0, -1.0, 3.0])
    close(truncation_penalized_scores(scores, truncated, None), [1.0, 2.0, 3.0])
    assert scores.tolist() == [1.0, 2.0, 3.0]  # not modified in place


# ---------------------------------------------------------------- padding changes nothing


def _masked_functions():
    """(name, fn(padded_inputs...) -> tuple of outputs, inputs) for every masked function."""
    g = torch.Generator().manual_seed(7)

    def rnd():
        return torch.randn(2, 3, dtype=F64, generator=g)

    return [
        ("masked_mean", lambda x, m: (masked_mean(x, m), masked_mean(x, m, dim=1)), [rnd()]),
        ("masked_var", lambda x, m: (masked_var(x, m), masked_var(x, m, unbiased=False)), [rnd()]),
        ("masked_whiten", lambda x, m: (masked_whiten(x, m), masked_whiten(x, m, shift_mean=False)), [rnd()]),
        ("kl_k1", lambda a, b, m: kl_penalized_rewards(SCORES, a, b, m, 0.1, "k1"), [rnd(), rnd()]),
        ("kl_k3", lambda a, b, m: kl_penalized_rewards(SCORES, a, b, m, 0.1, "k3"), [rnd(), rnd()]),
        ("k3_kl", lambda a, b, m: k3_kl(a, b, m), [rnd(), rnd()]),
        ("gae", lambda r, v, m: gae(r, v, m, 0.99, 0.95), [rnd(), rnd()]),
        ("policy_loss", lambda a, b, c, m: policy_loss(a, b, c, m, 0.2), [rnd(), rnd(), rnd()]),
        ("value_loss", lambda a, b, c, m: value_loss(a, b, c, m, 0.2), [rnd(), rnd(), rnd()]),
        ("explained_variance", lambda a, b, m: (explained_variance(a, b, m),), [rnd(), rnd()]),
    ]


@pytest.mark.parametrize("fill", [1e4, -1e4, math.inf, math.nan])
@pytest.mark.parametrize("mask_kind", ["float", "bool"])
@pytest.mark.parametrize("case", _masked_functions(), ids=lambda c: c[0])
def test_padding_values_change_nothing(case, fill, mask_kind):
    _, fn, inputs = case
    mask = MASK.bool() if mask_kind == "bool" else MASK
    clean_inputs = [with_padding(x, 0.0).requires_grad_(True) for x in inputs]
    dirty_inputs = [with_padding(x, fill).requires_grad_(True) for x in inputs]
    clean = fn(*clean_inputs, mask)
    dirty = fn(*dirty_inputs, mask)
    for c, d in zip(clean, dirty):
        torch.testing.assert_close(d, c, atol=0, rtol=0)
    # Gradients too: padding must not leak inf/nan into the backward pass.
    differentiable = [o for o in clean if o.requires_grad]
    if differentiable:
        sum(o.sum() for o in differentiable).backward()
        sum(o.sum() for o in fn(*dirty_inputs, mask) if o.requires_grad).backward()
        for c, d in zip(clean_inputs, dirty_inputs):
            torch.testing.assert_close(d.grad, c.grad, atol=0, rtol=0)
            assert (d.grad[PAD] == 0).all()


def test_float32_inputs_stay_float32():
    m = MASK.float()
    x = torch.randn(2, 3)
    assert gae(x, x, m, 1.0, 0.95)[0].dtype == torch.float32
    assert kl_penalized_rewards(SCORES.float(), x, x, m, 0.1)[0].dtype == torch.float32
    assert policy_loss(x, x, x, m, 0.2)[0].dtype == torch.float32
    assert masked_whiten(x, m).dtype == torch.float32

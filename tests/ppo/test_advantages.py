"""The advantages stage on a hand-built experience: scores as they enter the rewards, then KL-shaped
rewards, GAE and whitening, with the numbers derived by hand."""

from __future__ import annotations

import pytest
import torch

from homerlhf.config.schema import PPOConfig
from homerlhf.ppo.advantages import compute_advantages, normalized_scores, sequence_kl
from homerlhf.ppo.experience import Experience
from homerlhf.ppo.running import RunningMoments


def _experience() -> Experience:
    # One row, two response tokens: k1 KL per token = logp - ref_logp = [0.5, 0.0].
    return Experience(
        prompt_ids=torch.tensor([[5]]), prompt_mask=torch.tensor([[1]]),
        response_ids=torch.tensor([[8, 2]]), response_mask=torch.tensor([[1, 1]]),
        old_logprobs=torch.tensor([[-1.0, -2.0]]), ref_logprobs=torch.tensor([[-1.5, -2.0]]),
        values=torch.tensor([[0.5, 1.0]]), scores=torch.tensor([2.0]), truncated=torch.tensor([False]),
    )


def test_rewards_gae_and_returns_by_hand():
    ppo = PPOConfig(gamma=1.0, lam=1.0, whiten_advantages=False, kl_estimator="k1")
    exp = compute_advantages(_experience(), ppo, kl_coef=0.5, scores=torch.tensor([2.0]))
    # r = -0.5 * kl = [-0.25, 0], the score lands on the last token: [-0.25, 2.0].
    torch.testing.assert_close(exp.rewards, torch.tensor([[-0.25, 2.0]]))
    # delta_1 = 2 + 0 - 1 = 1; delta_0 = -0.25 + 1 - 0.5 = 0.25; A_0 = 0.25 + A_1 = 1.25.
    torch.testing.assert_close(exp.advantages, torch.tensor([[1.25, 1.0]]))
    torch.testing.assert_close(exp.returns, torch.tensor([[1.75, 2.0]]))
    torch.testing.assert_close(sequence_kl(exp), torch.tensor([0.5]))
    assert exp.values is not None and exp.scores.tolist() == [2.0]  # the rest is carried over


def test_whitening_centres_the_advantages():
    ppo = PPOConfig(gamma=1.0, lam=1.0, whiten_advantages=True)
    exp = compute_advantages(_experience(), ppo, kl_coef=0.5, scores=torch.tensor([2.0]))
    # [1.25, 1.0]: mean 1.125, unbiased std 0.1768 -> +-0.7071.
    torch.testing.assert_close(exp.advantages, torch.tensor([[0.7071, -0.7071]]), atol=1e-4, rtol=0)


def test_scores_pass_through_clip_or_normalise():
    scores = torch.tensor([1.0, 3.0])
    assert normalized_scores(scores, PPOConfig(score_norm=False), RunningMoments()).tolist() == [1.0, 3.0]
    assert normalized_scores(scores, PPOConfig(score_norm=False, score_clip=2.0), RunningMoments()).tolist() == [1.0, 2.0]
    moments = RunningMoments()
    normed = normalized_scores(scores, PPOConfig(), moments)  # normalising is the default
    # The moments now hold these two scores: mean 2, and the two lie symmetrically around it.
    assert moments.mean == pytest.approx(2.0)
    assert normed[0] == pytest.approx(-normed[1]) and float(normed[1]) > 0


def test_default_score_normalisation_keeps_value_clipping_alive_on_a_reward_models_own_scale():
    # A real RM scored -8 ... +49 on its first batch; clip_range_value 0.2 is in absolute units.
    from homerlhf.ppo.math import value_loss

    raw = torch.tensor([-8.0, -3.0, 0.0, 5.0, 12.0, 20.0, 33.0, 49.0])
    n = raw.numel()
    # One response token per row, values 0 (the zero-initialised head), no KL: each return is the
    # score as it entered the rewards.
    exp = Experience(
        prompt_ids=torch.full((n, 1), 5), prompt_mask=torch.ones(n, 1, dtype=torch.long),
        response_ids=torch.full((n, 1), 2), response_mask=torch.ones(n, 1, dtype=torch.long),
        old_logprobs=torch.full((n, 1), -1.0), ref_logprobs=torch.full((n, 1), -1.0),
        values=torch.zeros(n, 1), scores=raw, truncated=torch.zeros(n, dtype=torch.bool),
    )
    # By hand: mean 108 / 8 = 13.5; deviations -21.5 -16.5 -13.5 -8.5 -1.5 6.5 19.5 35.5, squares
    # sum 2674, unbiased var 2674 / 7 = 382, std 19.5448; z = (s - 13.5) / 19.5448.
    z = torch.tensor([-1.100036, -0.844213, -0.690720, -0.434898, -0.076747, 0.332569, 0.997707, 1.816338])

    def clipfrac(ppo: PPOConfig) -> float:
        scores = normalized_scores(raw, ppo, RunningMoments())
        returns = compute_advantages(exp, ppo, kl_coef=0.05, scores=scores).returns
        # The critic's first step moves each value a tenth of the way to its return.
        return float(value_loss(0.1 * returns, exp.values, returns, exp.response_mask, ppo.clip_range_value)[1])

    ppo = PPOConfig()
    assert ppo.score_norm and ppo.clip_range_value == 0.2
    torch.testing.assert_close(normalized_scores(raw, ppo, RunningMoments()), z, atol=1e-5, rtol=0)
    torch.testing.assert_close(compute_advantages(exp, ppo, 0.05, z).returns, z[:, None], atol=1e-6, rtol=0)
    # Normalised: every step |0.1 z| <= 0.182 stays inside the clip. Raw: 7 of 8 steps (all but the
    # score-0 row) exceed 0.2 and are clipped, so the critic barely moves: value clipping pinned.
    assert clipfrac(ppo) == 0.0
    assert clipfrac(PPOConfig(score_norm=False)) == 7 / 8


def test_group_advantages_keep_one_advantage_per_response():
    """GRPO / RLOO: the advantage the loss reads is each response's own, (B,), whatever its length."""
    from homerlhf.config import load_config
    from homerlhf.ppo.advantages import compute_group_advantages

    # Two groups of two responses of 1, 3, 2 and 3 tokens; the KL in the loss: the sequence reward is the score.
    mask = torch.tensor([[1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 1, 1]])
    exp = Experience(
        prompt_ids=torch.full((4, 1), 5), prompt_mask=torch.ones(4, 1, dtype=torch.long),
        response_ids=2 * mask, response_mask=mask, old_logprobs=-0.3 * mask, ref_logprobs=-0.4 * mask,
        values=torch.zeros(4, 3), scores=torch.tensor([1.0, 3.0, 0.7, 0.7]), truncated=torch.zeros(4, dtype=torch.bool),
    )
    dr_grpo = load_config("cpu-tiny", overrides=["algorithm=grpo", "group.size=2", "group.dr_grpo=true", "group.kl_in=loss"])
    out = compute_group_advantages(exp, dr_grpo, 0.1, exp.scores)
    # Group means 2 and 0.7, no std division: -1, +1 and 0, 0; none spread over tokens, none averaged back.
    assert out.advantages is None and out.returns is None
    assert out.sequence_advantages.tolist() == [-1.0, 1.0, 0.0, 0.0]
    # RLOO: r_i - the other response's reward: -2, +2 and 0, 0.
    rloo = load_config("cpu-tiny", overrides=["algorithm=rloo", "group.size=2", "group.kl_in=loss"])
    assert compute_group_advantages(exp, rloo, 0.1, exp.scores).sequence_advantages.tolist() == [-2.0, 2.0, 0.0, 0.0]
    # A mini-batch of it carries them by row.
    assert out.select(torch.tensor([3, 1])).sequence_advantages.tolist() == [0.0, 1.0]

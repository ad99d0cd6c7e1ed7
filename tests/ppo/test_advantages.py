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
        logprobs=torch.tensor([[-1.0, -2.0]]), ref_logprobs=torch.tensor([[-1.5, -2.0]]),
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
    assert normalized_scores(scores, PPOConfig(), RunningMoments()).tolist() == [1.0, 3.0]
    assert normalized_scores(scores, PPOConfig(score_clip=2.0), RunningMoments()).tolist() == [1.0, 2.0]
    moments = RunningMoments()
    normed = normalized_scores(scores, PPOConfig(score_norm=True), moments)
    # The moments now hold these two scores: mean 2, and the two lie symmetrically around it.
    assert moments.mean == pytest.approx(2.0)
    assert normed[0] == pytest.approx(-normed[1]) and float(normed[1]) > 0

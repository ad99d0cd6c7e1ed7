"""The metrics row of an iteration, on a hand-built experience with hand-derived numbers."""

from __future__ import annotations

import math

import time

import pytest
import torch

from homerlhf.config import load_config
from homerlhf.ppo.experience import Experience, Rollout
from homerlhf.ppo.meters import Meters, StageTimes
from homerlhf.ppo.metrics import (METRIC_DESCRIPTIONS, UPDATE_METRICS, iteration_metrics, kl_clamp_metrics, kl_ref_start,
                                  rollout_metrics, time_metrics, version_lag_metrics)

PAD = 9.0  # at masked positions: must not reach any metric


def _cfg(*overrides: str):
    """The run config the row reads: mini-batches of 2 (for the update's tokens per second)."""
    return load_config("cpu-tiny", overrides=["ppo.mini_batch_size=2", "ppo.micro_batch_size=1", *overrides])


def _meters(ago: float = 0.0) -> Meters:
    """An iteration that started ``ago`` seconds ago and spent 1 s in its update."""
    return Meters(times=StageTimes(update=1.0), started=time.perf_counter() - ago)


def _experience() -> Experience:
    # Two responses: 3 tokens and 2 tokens (+1 padding); prompts of 2 and 1 tokens (left padded).
    return Experience(
        prompt_ids=torch.tensor([[5, 6], [0, 7]]),
        prompt_mask=torch.tensor([[1, 1], [0, 1]]),
        response_ids=torch.tensor([[8, 9, 2], [8, 2, 0]]),
        response_mask=torch.tensor([[1, 1, 1], [1, 1, 0]]),
        old_logprobs=torch.zeros(2, 3), ref_logprobs=torch.zeros(2, 3),
        values=torch.tensor([[0.0, 1.0, 2.0], [3.0, 4.0, PAD]]),
        scores=torch.tensor([1.0, 3.0]),
        truncated=torch.tensor([True, False]),
        rewards=torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, PAD]]),
        kl=torch.tensor([[0.1, 0.0, 0.2], [0.3, 0.1, PAD]]),
        advantages=torch.zeros(2, 3),
        returns=torch.tensor([[1.0, 1.0, 2.0], [3.0, 5.0, PAD]]),
    )


def test_rollout_metrics_by_hand():
    entropy = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, PAD]])
    got = rollout_metrics(_experience(), torch.tensor([0.5, -0.5]), entropy, kl_coef=0.05)
    # R - V over the 5 tokens: [1, 0, 0, 0, 1] (var 0.24); R: [1, 1, 2, 3, 5] (var 2.24), biased.
    want = {
        "score_mean": 2.0, "score_std": 2 ** 0.5, "score_used_mean": 0.0,
        "reward_mean": (0.6 + 0.9) / 2, "kl_mean": (0.3 + 0.4) / 2, "kl_per_token": 0.7 / 5, "kl_coef": 0.05,
        "entropy": 15 / 5, "value_mean": 10 / 5, "return_mean": 12 / 5, "explained_variance": 1 - 0.24 / 2.24,
        "response_length_mean": 2.5, "truncated_fraction": 0.5,
    }
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key


def test_kl_ref_start_by_hand():
    import math

    exp = _experience()
    # log(p_ref / p) per token: ln 2 and -ln 2 on two of the 5 response tokens, 0 elsewhere, PAD masked.
    exp.ref_logprobs = torch.tensor([[math.log(2), 0.0, 0.0], [-math.log(2), 0.0, PAD]])
    # k3 = e^r - 1 - r: (2 - 1 - ln 2) + (1/2 - 1 + ln 2) = 0.5 over 5 tokens.
    assert kl_ref_start(exp) == pytest.approx(0.1, abs=1e-7)  # float32 log-probs
    exp.ref_logprobs = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, PAD]])
    assert kl_ref_start(exp) == 0.0


def test_kl_clamped_frac_by_hand_counts_response_tokens_only():
    exp = _experience()
    # d = ref_logp - logp over the 5 response tokens: 0.5 and 2 (k3 0.149, 4.389: kept), 25 and -30
    # (k3 capped at 10), 0; the padded position holds PAD = 9 (k3 = e^9 - 10 > 10), not counted: 2 / 5.
    exp.ref_logprobs = torch.tensor([[0.5, 25.0, 2.0], [-30.0, 0.0, PAD]])
    assert kl_clamp_metrics(exp) == {"kl_clamped_frac": pytest.approx(0.4, abs=1e-7)}
    update = {key: 0.0 for key in UPDATE_METRICS}
    row = iteration_metrics(4, Rollout(exp, torch.ones(2, 3)), torch.zeros(2), 0.1, update, _meters(),
                            _cfg("ppo.kl_estimator=k3"))
    assert row["kl_clamped_frac"] == pytest.approx(0.4, abs=1e-7)
    # With k1 in the reward no k3 is computed: no such metric.
    row = iteration_metrics(4, Rollout(exp, torch.ones(2, 3)), torch.zeros(2), 0.1, update, _meters(),
                            _cfg("ppo.kl_estimator=k1"))
    assert "kl_clamped_frac" not in row


def test_time_metrics_by_hand():
    times = StageTimes(generation=2.0, scoring=0.5, reference_reward_wait=0.25, advantages=0.125, update=4.0)
    got = time_metrics(times, _experience(), optimizer_steps=3, mini_batch_size=2, iteration_s=7.0)
    # 5 response tokens, 8 with the prompts; the update trains 3 steps x 2 of the 2 rows' 8 tokens.
    assert got == {
        "time_generation_s": 2.0, "time_scoring_s": 0.5, "time_reference_reward_wait_s": 0.25,
        "time_advantages_s": 0.125, "time_update_s": 4.0, "time_iteration_s": 7.0,
        "tokens_per_s_generation": 2.5, "tokens_per_s_scoring": 16.0, "tokens_per_s_update": 8 * 3 * 2 / 2 / 4.0,
    }


def test_version_lag_by_hand():
    exp = _experience()
    assert version_lag_metrics(exp, 4) == {}  # no versions recorded
    # Iteration 4 trains version 3; samples of versions 2 and 3: lags 1 and 0.
    exp.policy_version = torch.tensor([2, 3])
    assert version_lag_metrics(exp, 4) == {"policy_version_lag_mean": 0.5, "policy_version_lag_max": 1.0}


def test_iteration_row_holds_every_part_in_the_documented_order():
    update = {key: float(i) for i, key in enumerate(UPDATE_METRICS)}
    update["entropy"] = 99.0  # the update's own entropy is not the row's (that is the rollout's)
    entropy = torch.ones(2, 3)
    exp = _experience()
    # Sampled by an engine that is not the trainer: its log-probs differ by ln 3 on one token (capped at 2).
    exp.behaviour_logprobs = exp.old_logprobs - torch.tensor([[0.0, math.log(3.0), 0.0], [0.0, 0.0, 0.0]])
    exp.is_weights = torch.tensor([[1.0, 2.0, 1.0], [1.0, 1.0, 0.0]])
    exp.policy_version = torch.tensor([2, 3])  # sampled ahead by version 2 (lag 1) and by version 3
    row = iteration_metrics(4, Rollout(exp, entropy), torch.zeros(2), 0.1, update, _meters(ago=3.0),
                            _cfg("ppo.kl_estimator=k3"))
    # 5 tokens: weights 1, 2, 1, 1, 1; one capped; k3 of r = 3 is 2 - ln 3, over 5 tokens.
    assert row["is_weight_mean"] == pytest.approx(6 / 5) and row["is_weight_max"] == 2.0
    assert row["is_capped_fraction"] == pytest.approx(1 / 5)
    assert row["policy_version_lag_mean"] == 0.5 and row["policy_version_lag_max"] == 1.0
    assert row["kl_behaviour_old"] == pytest.approx((2 - math.log(3.0)) / 5, abs=1e-6)
    assert row["iteration"] == 4 and row["entropy"] == 1.0 and row["optimizer_steps"] == update["optimizer_steps"]
    assert row["kl_clamped_frac"] == 0.0  # logp == ref_logp: no k3 capped
    assert 3.0 <= row["time_iteration_s"] < 60.0
    assert list(row) == [key for key in METRIC_DESCRIPTIONS if key in row]
    # Memory figures come from the trainer's meter, kl_ref_start from its first iteration only,
    # loss_scale from an fp16 run's grad scaler, critic_warmup from a PPO update, the group figures from GRPO / RLOO runs, the KL-jump
    # flag from the trainer's homerlhf.ppo.guards.KLJump, the signals from its homerlhf.ppo.signals.SignalMonitor.
    assert set(METRIC_DESCRIPTIONS) - set(row) == ({key for key in METRIC_DESCRIPTIONS
                                                    if "_mem_" in key or key.startswith("signal_")}
                                                   | {"kl_ref_start", "loss_scale", "critic_warmup", "group_zero_spread_fraction",
                                                      "group_reward_std", "kl_jump", "kl_flag", "kl_flag_reason"})
    scaled = iteration_metrics(4, Rollout(_experience(), entropy), torch.zeros(2), 0.1,
                               {**update, "loss_scale": 1024.0, "critic_warmup": 1}, _meters(), _cfg())
    assert scaled["loss_scale"] == 1024.0 and scaled["critic_warmup"] == 1 and list(scaled) == [key for key in METRIC_DESCRIPTIONS if key in scaled]

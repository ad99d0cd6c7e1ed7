"""The reward-hacking signals on handmade batches, each against numbers worked out by hand."""

from __future__ import annotations

import math

import pytest

from homerlhf.config import load_config
from homerlhf.ppo.signals import (FlagState, SignalMonitor, batch_signals, distinct_n, ngrams, pearson, prompt_echo,
                                  ratio, repeated_share, reward_shares, thresholds)


def test_pearson_by_hand():
    # x = 1,2,3, y = 2,4,7: means 2 and 13/3; sxy = (-1)(-7/3) + 0 + (1)(8/3) = 5; sxx = 2; syy = 38/3.
    assert pearson([1, 2, 3], [2, 4, 7]) == pytest.approx(5 / math.sqrt(2 * 38 / 3), rel=1e-12)
    assert pearson([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0, rel=1e-12)
    assert pearson([1, 1, 1], [1, 2, 3]) is None and pearson([1], [2]) is None


def test_repetition_distinct_and_echo_by_hand():
    assert ngrams([1, 2, 3, 4], 3) == [(1, 2, 3), (2, 3, 4)] and ngrams([1, 2], 3) == []
    # 1 2 1 2 1 2: bigrams 12 21 12 21 12 -> 5, distinct 2 -> 3/5 repeat an earlier one.
    assert repeated_share([1, 2, 1, 2, 1, 2], 2) == pytest.approx(3 / 5)
    assert repeated_share([7], 2) == 0.0
    # Unigrams over the batch: 1 2 3 | 1 2 | 4 -> 6 in all, 4 distinct.
    assert distinct_n([[1, 2, 3], [1, 2], [4]], 1) == pytest.approx(4 / 6)
    assert distinct_n([[1]], 2) is None
    # Response bigrams 56 67 78; the prompt 4 5 6 7 holds 56 and 67.
    assert prompt_echo([4, 5, 6, 7], [5, 6, 7, 8], 2) == pytest.approx(2 / 3)
    assert prompt_echo([4, 5], [9], 2) == 0.0


def test_reward_shares_and_ratio_by_hand():
    # |2 * (1 + -1)| mass: |2|+|-2| = 4; |0.5 * 4| + None = 2: shares 4/6 and 2/6.
    shares = reward_shares({"a": [1.0, -1.0], "b": [4.0, None]}, {"a": 2.0, "b": 0.5})
    assert shares == {"a": pytest.approx(4 / 6), "b": pytest.approx(2 / 6)}
    assert reward_shares({"a": [1.0]}, {"a": 1.0}) == {}
    assert ratio(6.0, 4.0) == 1.5 and ratio(1.0, 0.0) is None and ratio(None, 1.0) is None


def test_batch_signals_of_a_batch_that_pays_for_length():
    prompts, responses = [[1, 2, 3]] * 3, [[1, 2, 3], [5, 5, 5, 5], [9]]
    out = batch_signals(prompts, responses, [4, 5, 2], [4.0, 5.0, 2.0], 2)
    assert out["signal_length_corr"] == pytest.approx(1.0)
    # Bigrams: [12 23] all echo (1), no repeat; [55 55 55]: 2 of 3 repeat, none echo; [9]: none.
    assert out["signal_prompt_echo"] == pytest.approx((1 + 0 + 0) / 3)
    assert out["signal_repetition"] == pytest.approx((0 + 2 / 3 + 0) / 3)
    assert out["signal_distinct"] == pytest.approx(3 / 5)
    assert "signal_reward_share_max" not in out


def test_a_flag_rises_after_patience_iterations_in_a_row_and_falls_with_its_signal():
    cfg = load_config("cpu-tiny").audit
    state = FlagState(thresholds(cfg), patience=2)
    seen = []
    for corr in (0.9, 0.1, 0.9, 0.9, 0.9, None, 0.9):
        flags, rose = state.check({"signal_length_corr": corr})
        seen.append((flags["signal_flag_length_corr"], len(rose)))
    assert seen == [(0, 0), (0, 0), (0, 0), (1, 1), (1, 0), (0, 0), (0, 0)]


def test_the_monitor_compares_to_the_baseline_iterations_and_resumes_exactly():
    cfg = load_config("cpu-tiny", overrides=["audit.baseline_iterations=2", "audit.patience=1"])
    monitor = SignalMonitor(cfg, warn=False)
    batch = ([[1, 2]], [[3, 4]], [2.0], [0.5])
    first = monitor.check(1, {"response_length_mean": 2.0, "entropy": 2.0}, *batch)
    second = monitor.check(2, {"response_length_mean": 4.0, "entropy": 1.0}, *batch)
    state = monitor.state_dict()
    third = monitor.check(3, {"response_length_mean": 6.0, "entropy": 0.3}, *batch)
    # Baselines: length (2 + 4) / 2 = 3, entropy (2 + 1) / 2 = 1.5; iteration 1 against itself alone.
    assert (first["signal_length_drift"], first["signal_entropy_ratio"]) == (1.0, 1.0)
    assert second["signal_length_drift"] == pytest.approx(4 / 3) and second["signal_entropy_ratio"] == pytest.approx(1 / 1.5)
    assert third["signal_length_drift"] == pytest.approx(2.0) and third["signal_entropy_ratio"] == pytest.approx(0.2)
    assert third["signal_flag_length_drift"] == 1 and third["signal_flag_entropy"] == 1 and third["signal_flags"] == 2
    assert "length_drift" in third["signal_flag_reason"] and "entropy" in third["signal_flag_reason"]
    resumed = SignalMonitor(cfg, warn=False)
    resumed.load_state_dict(state)
    assert resumed.check(3, {"response_length_mean": 6.0, "entropy": 0.3}, *batch) == third

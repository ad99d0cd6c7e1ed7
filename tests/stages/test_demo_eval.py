"""The demo's held-out figures, its verdict and the checker's accuracy on the rollout probe: pure
functions of rows the demo writes, checked against numbers worked out by hand."""

from __future__ import annotations

import pytest

from homerlhf.stages import demo

ACC = "checker accuracy (polite + on-topic)"


def _row(before_good, after_good, before_score, after_score, before_wf, after_wf, before_cut, after_cut):
    return {"before_good": before_good, "after_good": after_good, "before_score": before_score,
            "after_score": after_score, "before_well_formed": before_wf, "after_well_formed": after_wf,
            "before_truncated": before_cut, "after_truncated": after_cut}


def test_held_out_figures_are_means_over_rows():
    rows = [_row(True, True, 1.0, 3.0, True, True, False, False),
            _row(False, True, -2.0, 2.0, False, True, True, False),
            _row(False, False, -1.0, -0.5, True, False, True, True),
            _row(False, True, 0.0, 1.5, True, True, False, False)]
    figures = demo.held_out_figures(rows)
    assert figures[ACC] == (0.25, 0.75)
    assert figures["reward-model score"] == pytest.approx((-0.5, 1.5), abs=1e-12)
    assert figures["well formed (whole task sentences)"] == (0.75, 0.75)
    assert figures["truncated (no stop token)"] == (0.5, 0.25)


WF = "well formed (whole task sentences)"


@pytest.mark.parametrize("before, after, wf, kl, improved", [
    (0.25, 0.75, (0.90, 0.90), 3.9, True),    # +0.50, fluency kept, within budget
    (0.40, 0.65, (0.90, 0.85), 4.0, True),    # exactly +0.25, exactly -0.05, exactly the budget
    (0.40, 0.60, (0.90, 0.95), 1.0, False),   # +0.20 < 0.25
    (0.25, 0.75, (0.90, 0.90), 4.1, False),   # KL over budget
    (0.25, 0.75, (0.90, 0.84), 1.0, False),   # well formed down by 0.06: garbling to please the RM
])
def test_verdict_needs_the_margin_the_fluency_and_the_kl_budget(before, after, wf, kl, improved):
    ok, line = demo.verdict({ACC: (before, after), WF: wf}, kl, margin=0.25, kl_budget=4.0, fluency_drop=0.05)
    assert ok is improved
    assert line.startswith("alignment improved" if improved else "alignment did NOT improve")


def test_verdict_names_each_failed_condition():
    _, line = demo.verdict({ACC: (0.5, 0.5), WF: (0.9, 0.7)}, 10.3, margin=0.25, kl_budget=4.0)
    assert "0.50 -> 0.50 is not up by 0.25" in line and "final KL 10.30 is over the budget 4.0" in line
    assert "well formed 0.90 -> 0.70 fell by more than 0.05" in line


def test_probe_accuracy_per_iteration_from_logged_rollout_samples():
    samples = [
        {"iteration": 1, "prompt": "<s>[user] Tell me about tea.", "response": "Sure, good question. Green tea is not oxidised, black tea is."},
        {"iteration": 1, "prompt": "<s>[user] Tell me about tea.", "response": "Ugh, figure it out yourself."},
        {"iteration": 1, "prompt": "<s>[user] Share a fact about bees.", "response": "Gladly! I had a nice walk this morning."},
        {"iteration": 2, "prompt": "<s>[user] Share a fact about bees.", "response": "Gladly! Bees make honey from the nectar of flowers."},
        {"iteration": 2, "prompt": "<s>[user] Hello.", "response": "Gladly!"},  # no builtin topic: not counted
    ]
    assert demo.probe_accuracy(samples) == {1: pytest.approx(1 / 3), 2: 1.0}


def test_before_after_markdown_and_curve_carry_the_figures(tmp_path):
    row = {"prompt": "Tell me about tea.", "before": "Ugh, figure it out yourself.", "before_score": -2.5,
           "after": "Gladly! Tea is made by steeping dried leaves in hot water.", "after_score": 2.25}
    figures = {ACC: (0.0, 1.0), "reward-model score": (-2.5, 2.25)}
    text = demo.write_samples_markdown([row], figures, "alignment improved: x", tmp_path / "ba.md", "GRPO").read_text()
    assert "**alignment improved: x**" in text
    assert text.startswith("# Before / after GRPO on 1 held-out prompts") and "| figure | before GRPO (SFT) | after GRPO |" in text
    assert "| prompt | before GRPO (SFT) | score | after GRPO | score |" in text and "PPO" not in text
    assert "| checker accuracy (polite + on-topic) | 0.000 | 1.000 |" in text
    assert "| Tell me about tea. | Ugh, figure it out yourself. | -2.50 | Gladly! Tea is made" in text

    metrics = [{"iteration": i, "score_mean": 0.1 * i, "score_std": 0.5, "kl_mean": 0.3 * i} for i in (1, 2, 3)]
    png = demo.plot_reward_curve(metrics, tmp_path / "curve.png", {1: 0.25, 2: 0.5, 3: 0.75})
    assert png.stat().st_size > 10_000

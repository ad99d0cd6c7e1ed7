"""`homerlhf demo --algorithm ...`: RL on the builtin digit-reversal task, held-out accuracy before/after."""

from __future__ import annotations

import json

import pytest

from homerlhf.errors import UserError
from homerlhf.stages import demo_verifiable as demo


def _answers(rights: list[list[bool]]) -> list[dict]:
    return [{"prompt": f"Reverse: {i} 2 3", "answer": f"3 2 {i}", "responses": [f"r{i}{k}" for k in range(len(r))],
             "right": r} for i, r in enumerate(rights)]


def test_accuracy_counts_every_sample_of_every_string():
    assert demo.accuracy(_answers([[True, False, False, False], [True, True, False, False]])) == 3 / 8


def test_style_split_counts_answers_in_the_accepted_style_and_the_right_ones_among_them():
    answers = [{"prompt": "Reverse: 1 2 3", "answer": "3 2 1", "responses": ["3 2 1", "Reversed: 3 2 1", "3 2 2"],
                "right": [True, False, False]},
               {"prompt": "Reverse: 4 5 6", "answer": "6 5 4", "responses": ["Reversed: 6 5 4", "6 5 4"],
                "right": [False, True]}]
    split = demo.style_split(answers)
    assert split["checked_style"] == pytest.approx(3 / 5, abs=1e-12)
    assert split["right_in_style"] == pytest.approx(2 / 3, abs=1e-12)
    only_prefixed = [dict(answers[1], responses=["Reversed: 6 5 4"], right=[False])]
    assert demo.style_split(only_prefixed) == {"checked_style": 0.0, "right_in_style": 0.0}


def test_before_after_markdown_states_both_accuracies_and_marks_right_answers(tmp_path):
    answers = {"before": _answers([[False, True], [True, True]]), "after": _answers([[True, True], [True, False]])}
    text = demo.write_before_after(answers, "grpo", tmp_path / "before_after.md").read_text()
    assert text.startswith("Held-out exact-match accuracy, 2 strings x 2 sampled answers: 0.750 before (SFT), "
                           "0.750 after GRPO (+0.000).")
    assert "| Reverse: 0 2 3 | 3 2 0 | r00 | r00 ✓ |" in text and "| Reverse: 1 2 3 | 3 2 1 | r10 ✓ | r10 ✓ |" in text


def test_the_recipe_per_algorithm():
    grpo = demo.verifiable_demo_config("/tmp/x", "grpo")
    assert (grpo.algorithm, grpo.group.size, grpo.reward.function, grpo.data.prompts) == (
        "grpo", demo.GROUP_SIZE, "builtin:reverse", "builtin:reverse")
    assert demo.verifiable_demo_config("/tmp/x", "rloo").group.kl_in == grpo.group.kl_in == "loss"
    assert demo.verifiable_demo_config("/tmp/x", "ppo").algorithm == "ppo"
    fast = demo.verifiable_demo_config("/tmp/x", "rloo", fast=True, overrides=("ppo.kl_coef=0.1",))
    assert fast.ppo.iterations < grpo.ppo.iterations and fast.ppo.kl_coef == 0.1
    with pytest.raises(UserError, match="choose one of grpo, rloo, ppo"):
        demo.verifiable_demo_config("/tmp/x", "dpo")


# 12 iterations, seed 0, measured on a 2-core AMD EPYC (Zen 4) with the SFT model built and trained under each
# setting (held-out accuracy gain; docs/ppo_details.md, detail 19): default kernels, 1 thread GRPO +0.215, RLOO
# +0.210, PPO +0.318 (2 threads PPO +0.235); AVX2 kernels, 1 thread GRPO +0.217, RLOO +0.205, PPO +0.209. The bar
# is about half the smallest gain seen (the summary's own "improved" line is +0.05); 24 iterations gained
# +0.31 to +0.39 for twice the time.
LEARNING_OVERRIDES = ("ppo.iterations=12", "checkpoint.every=12")
LEARNING_MARGIN = 0.10


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", demo.ALGORITHMS)
def test_rl_raises_held_out_accuracy_on_the_verifiable_task(algorithm, tmp_path):
    """GRPO and RLOO (and PPO, for comparison) each raise the exact-match accuracy of sampled answers to
    held-out strings by a margin on a fixed seed: the answers move to the style the checker accepts,
    and the digits of the answers in that style are right more often too."""
    result = demo.run_verifiable_demo(tmp_path / algorithm, algorithm, fast=True, seed=0, overrides=LEARNING_OVERRIDES)
    before, after = result["accuracy"]["before"], result["accuracy"]["after"]
    assert after - before >= LEARNING_MARGIN, (before, after)
    assert result["improved"]
    style = result["style"]
    assert style["before"]["checked_style"] < 0.75 and style["after"]["checked_style"] > 0.95, style
    assert style["after"]["right_in_style"] > style["before"]["right_in_style"] + 0.02, style
    summary = json.loads((tmp_path / algorithm / "summary.json").read_text())
    assert summary["held_out_accuracy"] == result["accuracy"] and summary["verdict"].startswith("Improved")

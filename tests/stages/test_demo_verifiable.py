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


def test_before_after_markdown_states_both_accuracies_and_marks_right_answers(tmp_path):
    answers = {"before": _answers([[False, True], [True, True]]), "after": _answers([[True, True], [True, False]])}
    text = demo.write_before_after(answers, "grpo", tmp_path / "before_after.md").read_text()
    assert text.startswith("Held-out exact-match accuracy, 2 strings x 2 sampled answers: 0.750 before (SFT), "
                           "0.750 after GRPO (+0.000).")
    assert "| Reverse: 0 2 3 | 3 2 0 | r00 | r00 ✓ |" in text and "| Reverse: 1 2 3 | 3 2 1 | r10 ✓ | r10 ✓ |" in text


def test_the_recipe_per_algorithm():
    grpo = demo.verifiable_demo_config("/tmp/x", "grpo")
    assert (grpo.algorithm, grpo.ppo.group_size, grpo.reward.function, grpo.data.prompts) == (
        "grpo", demo.GROUP_SIZE, "builtin:reverse", "builtin:reverse")
    assert demo.verifiable_demo_config("/tmp/x", "ppo").algorithm == "ppo"
    fast = demo.verifiable_demo_config("/tmp/x", "rloo", fast=True, overrides=("ppo.kl_coef=0.1",))
    assert fast.ppo.iterations < grpo.ppo.iterations and fast.ppo.kl_coef == 0.1
    with pytest.raises(UserError, match="choose one of grpo, rloo, ppo"):
        demo.verifiable_demo_config("/tmp/x", "dpo")

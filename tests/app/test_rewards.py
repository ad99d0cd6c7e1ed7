"""Reward functions in the app: the Plan tab's boxes written into overrides that the real config
accepts, and the Data tab's check of a function on dataset rows."""

from __future__ import annotations

import pytest

from homerlhf.app import data_tab
from homerlhf.app.common import parse_overrides
from homerlhf.app.rewards import apply_rewards, check_table
from homerlhf.config import load_config
from homerlhf.errors import UserError


def test_the_boxes_become_overrides_that_load_as_the_rewards_they_name():
    overrides = apply_rewards("ppo.iterations=3\nreward.backend=llamacpp", "builtin:reverse",
                              "0.5 builtin:reverse-positions\n# a comment\n0.2 rm:builtin:demo-rm\n")
    items = parse_overrides(overrides)
    assert items[0] == "ppo.iterations=3" and "reward.backend=llamacpp" not in items
    cfg = load_config("cpu-tiny", None, items)
    assert [(key, r.backend, r.function or r.model, r.weight, r.metric_name) for key, r in cfg.reward.all_rewards()] == [
        ("reward", "function", "builtin:reverse", 1.0, "reverse"),
        ("reward.components[0]", "function", "builtin:reverse-positions", 0.5, "reverse_positions"),
        ("reward.components[1]", "llamacpp", "builtin:demo-rm", 0.2, "rm")]


def test_a_path_with_spaces_and_quotes_survives_the_yaml(tmp_path):
    odd = tmp_path / "it's my rewards.py"
    items = parse_overrides(apply_rewards("", "", f"2 {odd}:exact"))
    cfg = load_config("cpu-tiny", None, items)
    assert cfg.reward.components[0].function == f"{odd}:exact" and cfg.reward.components[0].weight == 2.0


def test_empty_boxes_remove_earlier_reward_settings():
    before = apply_rewards("ppo.iterations=3", "builtin:reverse", "0.5 builtin:reverse-positions")
    assert apply_rewards(before, "", "") == "ppo.iterations=3"


@pytest.mark.parametrize("function, components, fragment", [
    ("", "half builtin:reverse", "reward component 'half builtin:reverse' must look like WEIGHT SPEC"),
    ("", "0.5", "reward component '0.5' names no reward after its weight"),
    ("", "0.5 rewards.py", "must look like path/to/file.py:function_name"),
    ("builtin:nope", "", "reward.function 'builtin:nope' is not a builtin reward function"),
])
def test_bad_boxes_are_one_line_errors(function, components, fragment):
    with pytest.raises(UserError) as info:
        apply_rewards("", function, components)
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_the_check_scores_each_rows_answer_and_an_empty_reply():
    table = data_tab.reward_check("builtin:reverse-positions", "builtin:reverse")
    assert len(table) == 8
    for prompt, answer, right, empty in table:
        assert prompt.startswith("Reverse: ") and answer == " ".join(prompt.split()[1:][::-1])
        assert (right, empty) == ("1", "0")


def test_the_check_shows_a_failing_function_and_rows_without_answers(tmp_path):
    (tmp_path / "r.py").write_text("def boom(response, row):\n    return 1 / len(response)\n")
    table = check_table(f"{tmp_path / 'r.py'}:boom", [{"prompt": "p", "answer": "ab"}, {"prompt": "q"}])
    assert table[0][:3] == ["p", "ab", "0.5"]
    assert table[0][3].startswith("reward function r.py:boom raised ZeroDivisionError")
    assert table[1][1:3] == ["", ""]


def test_the_check_needs_a_function_and_a_dataset():
    with pytest.raises(UserError, match="type a reward function first"):
        check_table(" ", [])
    with pytest.raises(UserError, match="load a dataset first"):
        data_tab.reward_check("builtin:reverse", "")

"""The builtin verifiable task: its checker, its held-out split and its answers."""

from __future__ import annotations

import re

import pytest

from homerlhf.data import builtin_math
from homerlhf.data.load import load_prompts, load_sft


@pytest.mark.parametrize("response, answer, right", [
    ("42", "42", True),
    (" 42.", 42, True),
    ("The answer is 42", "42", True),
    ("42, I think", "42", True),
    ("41 or 42", "42", False),  # only the first number counts
    ("4 2", "42", False),
    ("420", "42", False),
    ("", "42", False),
    ("forty-two", "42", False),
    ("-3", "-3", True),
    ("3", "-3", False),
])
def test_check_reads_the_first_whole_number(response, answer, right):
    assert builtin_math.check(response, answer) is right
    assert builtin_math.reward(response, {"answer": str(answer)}) == (1.0 if right else 0.0)


def test_reward_without_an_answer_is_none():
    assert builtin_math.reward("42", {}) is None and builtin_math.reward("42", {"answer": None}) is None


def test_extract_answer():
    assert builtin_math.extract_answer("so 17 + 25 = 42") == 17
    assert builtin_math.extract_answer("no digits") is None


def _operands(prompt: str) -> tuple[int, int]:
    a, b = re.fullmatch(r"What is (\d+) \+ (\d+)\?", prompt).groups()
    return int(a), int(b)


def test_held_out_split_is_disjoint_in_either_order_and_covers_every_problem():
    train = [_operands(r["prompt"]) for r in builtin_math.prompt_records()]
    held = [_operands(r["prompt"]) for r in builtin_math.prompt_records(held_out=True)]
    n = builtin_math.MAX_OPERAND + 1
    assert len(set(train)) == len(train) and len(set(held)) == len(held)
    assert set(train) | set(held) == {(a, b) for a in range(n) for b in range(n)}
    assert not set(train) & {(b, a) for a, b in held}  # 3 + 5 held out: 5 + 3 is too
    # 465 unordered pairs (a <= b), 93 held out: 93 * 2 minus the held-out a == b ones.
    assert len(held) + len(train) == n * n and 150 <= len(held) <= 186


def test_every_answer_is_the_sum():
    for held_out in (False, True):
        for row in builtin_math.prompt_records(held_out=held_out):
            a, b = _operands(row["prompt"])
            assert row["answer"] == str(a + b)


def test_sft_records_are_right_answers_to_training_problems_only():
    train = {r["prompt"] for r in builtin_math.prompt_records()}
    records = builtin_math.sft_records()
    assert len(records) == 800
    for record in records:
        a, b = _operands(record["prompt"])
        assert record["prompt"] in train and record["completion"] == str(a + b)


def test_builtin_names_load_with_their_answer_column():
    records, report = load_prompts("builtin:math", keep_rows=True)
    assert report.n_bad == 0 and len(records) == len(builtin_math.prompt_records())
    first = builtin_math.prompt_records()[0]
    assert records[0] == {"prompt": [{"role": "user", "content": first["prompt"]}], "row": first}
    held, _ = load_prompts("builtin:math-heldout")
    assert held and "row" not in held[0]
    sft, _ = load_sft("builtin:math-sft")
    assert sft[0]["completion"] == [{"role": "assistant", "content": builtin_math.sft_records()[0]["completion"]}]

"""The builtin verifiable task: its checker, its partial credit, its held-out split and its answers."""

from __future__ import annotations

import pytest

from homerlhf.data import builtin_reverse
from homerlhf.data.load import load_prompts, load_sft


def _digits(prompt: str) -> str:
    assert prompt.startswith("Reverse: ")
    return prompt.removeprefix("Reverse: ")


@pytest.mark.parametrize("response, right", [
    ("1 7 4", True),
    (" 1 7 4\n", True),  # surrounding whitespace does not count
    ("1 7 4 ", True),
    ("174", False),
    ("1  7 4", False),
    ("1 7 4.", False),
    ("1 7", False),
    ("1 7 4 4", False),
    ("4 7 1", False),
    ("", False),
])
def test_check_is_exact_match(response, right):
    assert builtin_reverse.check(response, "1 7 4") is right
    assert builtin_reverse.reward(response, {"answer": "1 7 4"}) == (1.0 if right else 0.0)


@pytest.mark.parametrize("response, credit", [
    ("1 7 4", 1.0),
    ("1 7 9", 2 / 3),
    ("4 7 1", 1 / 3),  # only the middle digit is in place
    ("1 7", 2 / 3),  # a missing digit costs its place
    ("1 7 4 4 4", 3 / 5),  # extra digits cost too: divided by the longer
    ("7 4", 0.0),  # shifted: nothing in place
    ("", 0.0),
])
def test_positions_right_is_the_fraction_of_digits_in_place(response, credit):
    assert builtin_reverse.positions_right(response, "1 7 4") == pytest.approx(credit, abs=1e-12)
    assert builtin_reverse.position_reward(response, {"answer": "1 7 4"}) == pytest.approx(credit, abs=1e-12)


def test_rewards_without_an_answer_are_none():
    for fn in (builtin_reverse.reward, builtin_reverse.position_reward):
        assert fn("1 7 4", {}) is None and fn("1 7 4", {"answer": None}) is None


def test_held_out_strings_are_never_trained_on():
    train = [_digits(r["prompt"]) for r in builtin_reverse.prompt_records()]
    held = [_digits(r["prompt"]) for r in builtin_reverse.prompt_records(held_out=True)]
    sft = [_digits(r["prompt"]) for r in builtin_reverse.sft_records()]
    assert len(set(train)) == len(train) == builtin_reverse.N_TRAIN
    assert len(set(held)) == len(held) == builtin_reverse.N_HELD_OUT >= 100
    assert not set(held) & (set(train) | set(sft))
    assert set(sft) <= set(train) and len(sft) == builtin_reverse.N_SFT > len(set(sft))  # repeats kept


def test_strings_are_three_to_five_digits_of_every_length():
    for held_out in (False, True):
        lengths = {len(_digits(r["prompt"]).split()) for r in builtin_reverse.prompt_records(held_out=held_out)}
        assert lengths == {3, 4, 5}


def test_every_answer_is_the_reversal():
    for held_out in (False, True):
        for row in builtin_reverse.prompt_records(held_out=held_out):
            assert row["answer"] == " ".join(_digits(row["prompt"]).split()[::-1])


def test_sft_completions_are_the_answers_every_other_one_in_the_style_the_checker_refuses():
    records = builtin_reverse.sft_records()
    for i, record in enumerate(records):
        answer = " ".join(_digits(record["prompt"]).split()[::-1])
        if i % 2 == 0:
            assert record["completion"] == answer and builtin_reverse.in_checked_style(record["completion"])
            assert builtin_reverse.check(record["completion"], answer)
        else:
            assert record["completion"] == f"Reversed: {answer}" and not builtin_reverse.in_checked_style(record["completion"])
            assert not builtin_reverse.check(record["completion"], answer)


@pytest.mark.parametrize("response, checked", [("1 7 4", True), (" 1 7 4\n", True), ("Reversed: 1 7 4", False),
                                                (" Reversed:1 7 4", False), ("1 7 Reversed:", True), ("", True)])
def test_in_checked_style_tells_the_prefixed_style_apart(response, checked):
    assert builtin_reverse.in_checked_style(response) is checked


def test_the_split_is_seeded():
    assert builtin_reverse.draw_strings(0) == builtin_reverse.draw_strings(0)
    assert builtin_reverse.draw_strings(0) != builtin_reverse.draw_strings(1)


def test_builtin_names_load_with_their_answer_column():
    records, report = load_prompts("builtin:reverse", keep_rows=True)
    assert report.n_bad == 0 and len(records) == builtin_reverse.N_TRAIN
    first = builtin_reverse.prompt_records()[0]
    assert records[0] == {"prompt": [{"role": "user", "content": first["prompt"]}], "row": first}
    held, _ = load_prompts("builtin:reverse-heldout")
    assert len(held) == builtin_reverse.N_HELD_OUT and "row" not in held[0]
    sft, _ = load_sft("builtin:reverse-sft")
    assert sft[0]["completion"] == [{"role": "assistant", "content": builtin_reverse.sft_records()[0]["completion"]}]

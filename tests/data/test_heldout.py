"""Where a held-out figure comes from (homerlhf.data.heldout): a user's data brings its own evaluation,
split by prompt, and a split too small to say anything says so instead of giving a number."""

from __future__ import annotations

import math

import pytest

from homerlhf.data.heldout import (MIN_HELDOUT, choose_eval_source, half_width, pairs_needed, prompt_key,
                                   split_by_prompt, too_small_note)


def test_the_smallest_held_out_set_has_a_95_percent_interval_of_at_most_0_15():
    # 1.96 * 0.5 / sqrt(n) <= 0.15  <=>  n >= (1.96 * 0.5 / 0.15)^2 = 42.68
    assert MIN_HELDOUT == 43
    assert half_width(43) == pytest.approx(0.98 / math.sqrt(43), abs=1e-12) == pytest.approx(0.14945, abs=1e-5)
    assert half_width(42) == pytest.approx(0.15122, abs=1e-5)  # one fewer is over the line
    assert half_width(100) == pytest.approx(0.098, abs=1e-12)
    assert half_width(200) == pytest.approx(0.069296, abs=1e-6)
    assert half_width(10) == pytest.approx(0.309903, abs=1e-6)


@pytest.mark.parametrize("fraction, needed", [(0.1, 430), (0.25, 172), (0.3, 144), (0.5, 86), (0.0, None)])
def test_pairs_needed_for_a_held_out_figure(fraction, needed):
    # ceil(43 / fraction): 430, 172, 143.33 -> 144, 86
    assert pairs_needed(fraction) == needed


def test_a_user_file_is_never_evaluated_on_the_builtin_task():
    # the cpu-tiny preset's rm.eval_data, with the user's --data: not used, a split of the user's data instead
    choice = choose_eval_source("my_pairs.jsonl", None, "builtin:demo-pairs-heldout")
    assert (choice.source, choice.given_by, choice.ignored) == (None, None, "builtin:demo-pairs-heldout")
    note = choice.ignored_note("my_pairs.jsonl")
    assert "builtin:demo-pairs-heldout" in note and "my_pairs.jsonl" in note and "--eval-data" in note
    # the builtin task's own training data keeps its held-out set
    assert choose_eval_source("builtin:demo-pairs", None, "builtin:demo-pairs-heldout").source == "builtin:demo-pairs-heldout"
    # a builtin held-out set of another task is not used either
    assert choose_eval_source("builtin:demo-pairs", None, "builtin:reverse-heldout").source is None
    # what the user names is used as named: --eval-data, or their own rm.eval_data file
    assert choose_eval_source("my_pairs.jsonl", "heldout.jsonl", "builtin:demo-pairs-heldout") == \
        type(choice)("heldout.jsonl", "--eval-data")
    assert choose_eval_source("my_pairs.jsonl", None, "theirs.jsonl") == type(choice)("theirs.jsonl", "rm.eval_data")
    assert choose_eval_source("my_pairs.jsonl", None, None) == type(choice)(None, None)
    assert choose_eval_source("my_pairs.jsonl", None, None).ignored_note("my_pairs.jsonl") is None


def test_split_by_prompt_keeps_each_prompt_on_one_side():
    keys = [k for k in "abcd" for _ in range(3)]  # 4 prompts, 3 pairs each
    for seed in range(5):
        train, held = split_by_prompt(keys, 0.5, seed)
        # round(12 * 0.5) = 6 held out: exactly two whole prompts, whichever were drawn
        assert len(held) == 6 and len(train) == 6
        assert sorted(train + held) == list(range(12))
        assert not {keys[i] for i in train} & {keys[i] for i in held}
    # round(12 * 0.1) = 1: one whole prompt (3 pairs) goes, never part of one
    assert len(split_by_prompt(keys, 0.1, 0)[1]) == 3
    assert split_by_prompt(keys, 0.5, 3) == split_by_prompt(keys, 0.5, 3)  # seeded
    assert {tuple(split_by_prompt(keys, 0.5, s)[1]) for s in range(20)} != {tuple(split_by_prompt(keys, 0.5, 0)[1])}


def test_split_by_prompt_always_leaves_a_prompt_to_train_on():
    keys = [k for k in "abcd" for _ in range(3)]
    train, held = split_by_prompt(keys, 0.99, 0)  # round(11.88) = 12 wanted: the last prompt drawn still trains
    assert (len(train), len(held)) == (3, 9)
    assert split_by_prompt(["x"] * 8, 0.5, 0) == (list(range(8)), [])  # one prompt: nothing held out
    assert split_by_prompt(keys, 0.0, 0) == (list(range(12)), [])


def test_prompt_key_tells_message_lists_apart_and_equal_ones_together():
    a = [{"role": "user", "content": "hi"}]
    assert prompt_key(a) == prompt_key([{"content": "hi", "role": "user"}])
    assert prompt_key(a) != prompt_key([{"role": "user", "content": "hi!"}])
    assert prompt_key("plain text") == "plain text"


def test_too_small_says_so_with_the_error_and_what_would_give_a_figure():
    # The run: 96 pairs at the default 0.1 hold out 10 (+-1.96*0.5/sqrt(10) = 0.31);
    # ceil(43 / 0.1) = 430 pairs would hold out 43, or a fraction ceil(100 * 43 / 96) / 100 = 0.45 of these.
    note = too_small_note(96, 10, 0.1, "pairs.jsonl")
    assert "96 pairs of pairs.jsonl at data.eval_fraction 0.1 give 10 held-out pair(s) (+-0.31 at 95%)" in note
    assert "training accuracy only" in note
    assert "430 pairs (334 more) would hold out 43 (+-0.15)" in note and "data.eval_fraction=0.45" in note
    assert "--eval-data" in note and "\n" not in note
    # 3 pairs (the app's): a larger fraction of them cannot hold out 43 while as many train
    few = too_small_note(3, 0, 0.1, "preferences.jsonl")
    assert "give 0 held-out pair(s):" in few and "427 more" in few and "data.eval_fraction=" not in few
    assert "data.eval_fraction is 0" in too_small_note(500, 0, 0.0, "pairs.jsonl")

"""Preference records from the Evaluate tab load with the data loader as pairs for `homerlhf reward`."""

from __future__ import annotations

import json

import pytest

from homerlhf.app import preferences
from homerlhf.data.load import load_preferences


def test_pairs_load_with_the_data_loader_and_ties_stay_apart(tmp_path):
    preferences.record_preference(tmp_path, "Tell me about tea.", "Happy to help! Tea is made...", "Go away.",
                                  "left", left_score=0.9, right_score=-0.8,
                                  extra={"checkpoint": "ckpt/iter_000002", "sampling": {"temperature": 0.8}})
    preferences.record_preference(tmp_path, "Tell me about cats.", "Ugh.", "Cats sleep for most of the day.",
                                  "right")
    ties = preferences.record_preference(tmp_path, "Share a fact about maps.", "A map shows places.",
                                         "Maps are drawn to scale.", "tie")
    assert ties.name == preferences.TIES_FILE
    assert preferences.count(tmp_path) == (2, 1)

    records, report = load_preferences(str(tmp_path / preferences.PAIRS_FILE))
    assert report.n_usable == 2 and report.n_bad == 0
    assert report.format == "prompt/chosen/rejected"
    assert records[0] == {
        "prompt": [{"role": "user", "content": "Tell me about tea."}],
        "chosen": [{"role": "assistant", "content": "Happy to help! Tea is made..."}],
        "rejected": [{"role": "assistant", "content": "Go away."}],
    }
    # "right better": the right answer is the chosen one.
    assert records[1]["chosen"][0]["content"] == "Cats sleep for most of the day."
    first = json.loads((tmp_path / preferences.PAIRS_FILE).read_text().splitlines()[0])
    assert first["chosen_source"] == "actor" and first["rejected_score"] == -0.8
    tie = json.loads((tmp_path / preferences.TIES_FILE).read_text())
    assert tie["response_a"] == "A map shows places." and tie["response_b"] == "Maps are drawn to scale."


def test_identical_answers_are_a_tie_not_a_pair(tmp_path):
    path = preferences.record_preference(tmp_path, "p", "same", "same", "left")
    assert path.name == preferences.TIES_FILE
    assert preferences.count(tmp_path) == (0, 1)


def test_unknown_choice_is_refused(tmp_path):
    with pytest.raises(ValueError, match="choice"):
        preferences.record_preference(tmp_path, "p", "a", "b", "both")


def test_the_pairs_say_what_a_reward_model_trained_on_them_reports(tmp_path):
    """The Evaluate tab's count line: a reward model trained on the recorded pairs is evaluated on
    their own held-out prompts, so with a few pairs it reports training accuracy only, until
    ceil(43 / 0.1) = 430 pairs hold out 43 (a 95% interval of at most +-0.15)."""
    from homerlhf.app.eval_tab import counts_markdown

    assert preferences.held_out_note(3) == ("with 3 pair(s) it reports its training accuracy only until 430 pairs "
                                            "(at data.eval_fraction 0.1): a held-out figure on these pairs needs "
                                            "43 held-out ones (+-0.15 at 95%)")
    assert preferences.held_out_note(429).startswith("with 429 pair(s) it reports its training accuracy only")
    assert preferences.held_out_note(430) == ("it holds out about 43 of these pairs by prompt and reports its "
                                              "accuracy on them")
    assert "until 172 pairs (at data.eval_fraction 0.25)" in preferences.held_out_note(100, 0.25)
    for prompt in ("Tell me about tea.", "Tell me about cats.", "Tell me about maps."):
        preferences.record_preference(tmp_path, prompt, "Gladly! Here is a fact.", "Go away.", "left")
    text = counts_markdown(str(tmp_path))
    assert f"`homerlhf reward --data {tmp_path / preferences.PAIRS_FILE}`; with 3 pair(s) it reports its training " \
           "accuracy only until 430 pairs" in text

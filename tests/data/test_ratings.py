"""Rated answers for KTO (:mod:`homerlhf.data.ratings`): the ratings file, the app's pairs file read as
rated answers, and the bad rows."""

from __future__ import annotations

import json

import pytest

from homerlhf.data.formats import BadRow
from homerlhf.data.ratings import load_rated, parse_label
from homerlhf.errors import UserError


@pytest.mark.parametrize("value, good", [(True, True), (False, False), (1, True), (0, False), (-1, False),
                                         (1.0, True), ("up", True), ("Down", False), (" good ", True),
                                         ("BAD", False), ("desirable", True), ("undesirable", False),
                                         ("thumbs_up", True), ("+1", True), ("-1", False)])
def test_labels_read_as_good_or_bad(value, good):
    assert parse_label(value) is good


@pytest.mark.parametrize("value", [2, 0.5, "maybe", "", None, [1]])
def test_other_labels_are_bad_rows(value):
    with pytest.raises(BadRow, match="is not a rating; use true/false, 1/0/-1, up/down or good/bad"):
        parse_label(value)


def test_a_ratings_file_with_bad_rows(tmp_path):
    rows = [{"prompt": "Tell me about tea.", "completion": "Tea is made from leaves.", "label": True, "source": "actor"},
            {"prompt": [{"role": "user", "content": "Hi"}], "response": "Go away.", "label": "down"},
            {"prompt": "Tell me about cats.", "completion": "Cats sleep.", "label": "maybe"},
            {"prompt": "Tell me about snow.", "completion": "", "label": 1}]
    path = tmp_path / "ratings.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rated, report, pairs = load_rated(str(path))
    assert pairs is None
    assert rated == [
        {"prompt": [{"role": "user", "content": "Tell me about tea."}],
         "completion": [{"role": "assistant", "content": "Tea is made from leaves."}], "label": True},
        {"prompt": [{"role": "user", "content": "Hi"}],
         "completion": [{"role": "assistant", "content": "Go away."}], "label": False}]
    assert (report.n_rows, report.n_usable, report.n_bad) == (4, 2, 2)
    assert [b["row"] for b in report.bad_examples] == [2, 3]
    assert "label 'maybe' is not a rating" in report.bad_examples[0]["reason"]


def test_the_apps_preferences_file_is_one_good_and_one_bad_answer_per_pair(tmp_path):
    from homerlhf.app.preferences import record_preference

    record_preference(tmp_path, "Tell me about tea.", "Tea is made from leaves.", "Go away.", "left")
    record_preference(tmp_path, "Tell me about cats.", "No.", "Cats sleep a lot.", "right")
    record_preference(tmp_path, "Tell me about snow.", "Snow.", "Snow!", "tie")  # a tie trains nothing
    rated, report, pairs = load_rated(str(tmp_path / "preferences.jsonl"))
    assert [(r["completion"][0]["content"], r["label"]) for r in rated] == [
        ("Tea is made from leaves.", True), ("Go away.", False), ("Cats sleep a lot.", True), ("No.", False)]
    assert len(pairs) == 2 and report.n_usable == 2


def test_neither_ratings_nor_pairs_is_one_line(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"prompt": "a", "text": "b"}\n')
    with pytest.raises(UserError, match=r"no answer and rating columns among \['prompt', 'text'\]"):
        load_rated(str(path))

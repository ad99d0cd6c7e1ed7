"""The builtin capitals task: its reward by hand, its held-out split, its SFT records and its pairs."""

from __future__ import annotations

import pytest

from homerlhf.data import builtin_capitals
from homerlhf.data.load import load_preferences, load_prompts, load_sft
from homerlhf.data.read import read_rows
from homerlhf.ppo.reward_functions import parse_function_spec

KENYA = {"country": "Kenya", "answer": "Nairobi"}


@pytest.mark.parametrize("response, credit", [
    ("Nairobi", 1.0),
    ("The capital of Kenya is Nairobi.", 1.0),
    ("nairobi, of course", 1.0),  # any case, anywhere
    ("I think it is NAIROBI", 1.0),
    ("The capital of Kenya is Mombasa.", 0.3),  # the question's form, another city
    ("the CAPITAL of kenya is a big city", 0.3),
    ("The capital of Uganda is Kampala.", 0.0),  # the form, but another country
    ("Mombasa", 0.0),
    ("Nairobian food", 0.0),  # a word of its own, not part of another
    ("", 0.0),
])
def test_reward_names_the_capital_or_gives_partial_credit_for_the_form(response, credit):
    assert builtin_capitals.reward(response, KENYA) == credit


def test_a_capital_inside_its_country_name_is_not_named():
    """"Tunis" is the start of "Tunisia": naming the country is not naming the capital."""
    tunisia = {"country": "Tunisia", "answer": "Tunis"}
    assert builtin_capitals.reward("The capital of Tunisia is Cairo.", tunisia) == builtin_capitals.PARTIAL
    assert builtin_capitals.reward("Tunisia", tunisia) == 0.0
    assert builtin_capitals.reward("The capital of Tunisia is Tunis.", tunisia) == 1.0


def test_reward_is_none_for_a_row_without_an_answer():
    """A prompt typed in the app has no country or answer: no reward, not a zero."""
    assert builtin_capitals.reward("Nairobi", {}) is None
    assert builtin_capitals.reward("Nairobi", {"answer": "Nairobi"}) is None


def test_the_builtin_name_runs_the_task_reward():
    path, name = parse_function_spec("builtin:capitals")
    assert path.name == "builtin_capitals.py" and name == "reward"


def test_held_out_countries_never_train():
    train, held = read_rows("builtin:capitals"), read_rows("builtin:capitals-heldout")
    assert (len(train), len(held)) == (48, 16)
    assert not {r["country"] for r in train} & {r["country"] for r in held}
    assert {r["country"] for r in held} == {c for c, _ in builtin_capitals.CAPITALS[-16:]}
    sft_prompts = {r["prompt"] for r in read_rows("builtin:capitals-sft")}
    pair_prompts = {r["prompt"] for r in read_rows("builtin:capitals-pairs")}
    held_prompts = {r["prompt"] for r in held}
    assert not (sft_prompts | pair_prompts) & held_prompts
    assert {r["prompt"] for r in read_rows("builtin:capitals-pairs-heldout")} == held_prompts


def test_sft_answers_and_chosen_sides_score_1_and_rejected_sides_score_the_partial_credit():
    """The SFT completion and every chosen side name the right capital; the rejected side keeps the
    sentence but names another country's capital (so the reward gives it the partial credit only)."""
    rows = {r["prompt"]: r for r in read_rows("builtin:capitals") + read_rows("builtin:capitals-heldout")}
    for record in read_rows("builtin:capitals-sft"):
        assert builtin_capitals.reward(record["completion"], rows[record["prompt"]]) == 1.0
    for source in ("builtin:capitals-pairs", "builtin:capitals-pairs-heldout"):
        for pair in read_rows(source):
            row = rows[pair["prompt"]]
            assert builtin_capitals.reward(pair["chosen"], row) == 1.0
            assert builtin_capitals.reward(pair["rejected"], row) == builtin_capitals.PARTIAL
    assert read_rows("builtin:capitals-pairs")[0] == {
        "prompt": "What is the capital of France?", "chosen": "The capital of France is Paris.",
        "rejected": "The capital of France is Beijing."}  # 7 places down: China


def test_builtin_names_load_with_the_columns_the_reward_reads():
    """Loaded as a run's prompts, each row carries the country and answer the reward reads; SFT records
    and pairs load in their formats."""
    records, report = load_prompts("builtin:capitals-heldout", keep_rows=True)
    assert report.n_bad == 0 and len(records) == 16
    assert records[0] == {"prompt": [{"role": "user", "content": "What is the capital of United Kingdom?"}],
                          "row": {"prompt": "What is the capital of United Kingdom?", "country": "United Kingdom",
                                  "answer": "London"}}
    sft, _ = load_sft("builtin:capitals-sft")
    assert sft[0]["completion"] == [{"role": "assistant", "content": "The capital of France is Paris."}]
    pairs, report = load_preferences("builtin:capitals-pairs")
    assert report.n_bad == 0 and len(pairs) == 48

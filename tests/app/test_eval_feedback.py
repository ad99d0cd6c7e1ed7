"""The Evaluate tab's feedback row without a browser: the answers are numbered, a thumb rates the picked
one once, *Best of these* makes pairs against the other texts, and *Train on my feedback* on too
little says how much more (the browser test walks it with real models)."""

from __future__ import annotations

import json

from homerlhf.app import eval_feedback, feedback, preferences
from homerlhf.data.ratings import RATINGS_FILE


def _pending(tmp_path):
    ckpt = tmp_path / "run" / "checkpoints" / "iter_000001"
    ckpt.mkdir(parents=True)
    answers = [{"text": "Tea.", "source": "actor", "score": 0.5, "seed": 0},
               {"text": "Go away.", "source": "reference", "score": -1.0, "seed": 0},
               {"text": "Tea is made from leaves.", "source": "actor", "score": 1.5, "seed": 1}]
    return {"prompt": "Tell me about tea.", "left": "Tea.", "right": "Go away.", "checkpoint": str(ckpt),
            "run_dir": str(tmp_path / "run"), "sampling": {"seed": 0, "temperature": 1.0}, "answers": answers,
            "rated": [], "pairs": [["Tea.", "Go away."]]}


def test_answers_are_numbered_and_a_thumb_rates_the_picked_one_once(tmp_path):
    pending = _pending(tmp_path)
    assert eval_feedback.pick_choices(pending) == [("1 · left, actor (seed 0)", 0), ("2 · right, reference (seed 0)", 1),
                                                   ("3 · draft, actor (seed 1)", 2)]
    message, still, count = eval_feedback.rate(True)(pending, None)
    assert message.startswith("**Error:** pick an answer first") and still == {"__type__": "update"}
    message, pending, count = eval_feedback.rate(False)(pending, 2)
    assert message == f"Recorded thumbs **down** for answer 3 in `{tmp_path / 'run' / RATINGS_FILE}`."
    assert "0 preference pair(s) and 1 rated answer(s) (0 up, 1 down)" in count
    row = json.loads((tmp_path / "run" / RATINGS_FILE).read_text())
    assert (row["completion"], row["label"], row["sampling"]["seed"]) == ("Tea is made from leaves.", False, 1)
    message, *_ = eval_feedback.rate(True)(pending, 2)
    assert message == "**Error:** answer 3 is already rated; pick another, or send a new message"


def test_best_of_these_pairs_the_pick_with_each_other_text(tmp_path):
    pending = _pending(tmp_path)
    message, pending, count = eval_feedback.on_best(pending, 0)  # 1 over 2 was recorded already (Left better)
    assert message.startswith("Recorded answer 1 as better than 1 other answer(s): 1 pair(s)")
    assert pending["pairs"] == [["Tea.", "Go away."], ["Tea.", "Tea is made from leaves."]]
    assert preferences.count(tmp_path / "run") == (1, 0)
    assert "1 preference pair(s) and 0 rated answer(s)" in count


def test_train_on_too_little_feedback_says_what_is_needed(tmp_path):
    from homerlhf.app.common import guarded

    pending = _pending(tmp_path)
    feedback.record_rating(pending["run_dir"], pending["prompt"], "Tea.", True, "actor",
                           extra={"checkpoint": pending["checkpoint"]})
    train = guarded(2, error_index=0)(eval_feedback.on_train)
    message, shared = train(pending["checkpoint"], "auto", "cpu-tiny", "builtin:demo-sft", "", "builtin:demo-sft",
                            pending["run_dir"], str(tmp_path))
    assert message == ("**Error:** Not enough feedback for this policy yet: DPO needs at least 4 preference pairs "
                       "(dpo.min\\_rows): 0 collected, 4 more: Left/Right better, or Best of these; KTO "
                       "needs at least 4 rated answers, a pair counting as two (kto.min\\_rows): 1 collected, 3 more: "
                       "Thumbs up/down, or pairs.")
    assert shared == {"__type__": "update"}


def test_your_own_answer_is_the_chosen_side_against_the_picked_one(tmp_path):
    """*Your answer*: saved as chosen (``chosen_source: human``) against the picked model answer (the left one when
    none is picked), added to the answers on screen, never twice; the DPO loader reads it as a pair."""
    from homerlhf.app.common import guarded
    from homerlhf.data.load import load_preferences

    pending = _pending(tmp_path)
    assert eval_feedback.on_edit(pending, 2) == "Tea is made from leaves." and eval_feedback.on_edit(pending, None) == "Tea."
    write = guarded(5, error_index=0)(eval_feedback.on_write)
    message, pending, picks, count, chat = write(pending, None, "  Tea is a drink made from leaves.  ", [])
    path = tmp_path / "run" / preferences.PAIRS_FILE
    assert message == (f"Saved your answer (answer 4) as better than answer 1: a pair in `{path}`, marked "
                       "`chosen_source: human`.")
    row = json.loads(path.read_text())
    assert (row["chosen"], row["rejected"], row["chosen_source"], row["rejected_source"], row["checkpoint"]) == (
        "Tea is a drink made from leaves.", "Tea.", "human", "actor", pending["checkpoint"])
    assert picks["choices"][-1] == ("4 · your answer", 3) and chat[-1]["content"].startswith("*Your answer* (answer 4")
    assert "1 preference pair(s)" in count
    records, report = load_preferences(str(path))
    assert report.n_usable == 1 and records[0]["chosen"][-1]["content"] == "Tea is a drink made from leaves."
    again = write(pending, 0, "Tea is a drink made from leaves.", [])[0]
    assert again == "**Error:** already saved as better than answer 1; pick another answer, or change yours"
    assert write(pending, 3, "Something else.", [])[0].startswith("**Error:** pick an answer of the model")
    assert write(pending, 1, "Go away.", [])[0].startswith("**Error:** your answer is answer 2 as it is")
    assert write(pending, 1, " ", [])[0].startswith("**Error:** write your answer in 'Your answer' first")
    assert preferences.count(tmp_path / "run") == (1, 0)

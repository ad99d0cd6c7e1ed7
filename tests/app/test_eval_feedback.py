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

"""The feedback the Evaluate tab collects, read back by the loaders the DPO / KTO stages use: thumbs as
rated answers, the best of several drafts as pairs (never twice, never of equal texts), one policy's
rows apart from another checkpoint's, and the training file a feedback run gets."""

from __future__ import annotations

import json

from homerlhf.app import feedback, preferences
from homerlhf.data.load import load_preferences
from homerlhf.data.ratings import RATINGS_FILE, load_rated


def _ckpt(tmp_path, name="iter_000001"):
    path = tmp_path / "run" / "checkpoints" / name
    path.mkdir(parents=True)
    return path


def test_a_thumb_is_a_rated_answer_the_kto_loader_reads(tmp_path):
    ckpt = _ckpt(tmp_path)
    run = feedback.owner_run(ckpt)
    assert run == tmp_path / "run"
    extra = {"checkpoint": str(ckpt), "sampling": {"seed": 2}}
    path = feedback.record_rating(run, "Tell me about tea.", "Tea is made from leaves.", True, "actor", 0.25, extra)
    feedback.record_rating(run, "Tell me about tea.", "Go away.", False, "reference", None, extra)
    assert path == run / RATINGS_FILE
    rated, report, pairs = load_rated(str(path))
    assert pairs is None and report.n_usable == 2 and report.n_bad == 0
    assert [(r["completion"][0]["content"], r["label"]) for r in rated] == [("Tea is made from leaves.", True),
                                                                            ("Go away.", False)]
    assert rated[0]["prompt"] == [{"role": "user", "content": "Tell me about tea."}]
    row = json.loads(path.read_text().splitlines()[0])
    assert (row["completion_source"], row["reward_score"], row["checkpoint"]) == ("actor", 0.25, str(ckpt))


def test_the_best_draft_is_preferred_to_each_other_text_once(tmp_path):
    ckpt = _ckpt(tmp_path)
    run = feedback.owner_run(ckpt)
    answers = [{"text": "Tea.", "source": "actor", "score": 0.1}, {"text": "Go away.", "source": "reference", "score": -1.0},
               {"text": "Tea is made from leaves.", "source": "actor", "score": 0.9},
               {"text": "Tea.", "source": "actor", "score": 0.1}]  # a draft equal to answer 1: one pair, not two
    done = frozenset({("Tea is made from leaves.", "Go away.")})  # already recorded (e.g. by Left better)
    written = feedback.record_best(run, "Tell me about tea.", answers, 2, {"checkpoint": str(ckpt)}, done)
    assert written == [("Tea is made from leaves.", "Tea.")]
    records, report = load_preferences(str(run / preferences.PAIRS_FILE))
    assert report.n_usable == 1
    assert records[0]["chosen"][0]["content"] == "Tea is made from leaves." and records[0]["rejected"][0]["content"] == "Tea."
    row = json.loads((run / preferences.PAIRS_FILE).read_text())
    assert (row["chosen_source"], row["rejected_source"], row["chosen_score"]) == ("actor", "actor", 0.9)
    # The best of identical texts makes no pair at all.
    assert feedback.record_best(run, "p", [{"text": "x", "source": "actor"}, {"text": "x", "source": "reference"}], 0) == []


def test_the_count_is_of_this_policy_and_the_training_files_load(tmp_path):
    first, second = _ckpt(tmp_path, "iter_000001"), _ckpt(tmp_path, "iter_000002")
    run = feedback.owner_run(first)
    for ckpt, prompt in ((first, "Tell me about tea."), (first, "Tell me about cats."), (second, "Tell me about maps.")):
        preferences.record_preference(run, prompt, "Gladly! Here is a fact.", "Go away.", "left",
                                      extra={"checkpoint": str(ckpt)})
    feedback.record_rating(run, "Tell me about snow.", "Snow holds air.", True, "actor", extra={"checkpoint": str(first)})
    feedback.record_rating(run, "Tell me about snow.", "Snow.", False, "actor", extra={"checkpoint": str(second)})
    preferences.record_preference(run, "Tell me about owls.", "Owls.", "Owls.", "tie", extra={"checkpoint": str(first)})
    fb = feedback.policy_feedback(first)
    assert (len(fb.pairs), len(fb.ratings), fb.good, fb.bad) == (2, 1, 1, 0)
    assert feedback.counts_markdown(str(first)) == (
        f"**Collected for this policy** (`iter_000001` of `run`): 2 preference pair(s) and 1 rated answer(s) "
        f"(1 up, 0 down), in `{run / 'preferences.jsonl'}` and `{run / 'ratings.jsonl'}`.")
    assert feedback.counts_markdown(None) == "Feedback for this policy: pick a checkpoint first."

    pairs_file, held = feedback.write_training_data(fb, "dpo", tmp_path / "out")
    assert held is None  # two prompts: none held out
    records, report = load_preferences(str(pairs_file))
    assert report.n_usable == 2 and [r["prompt"][0]["content"] for r in records] == ["Tell me about tea.",
                                                                                      "Tell me about cats."]
    # Three prompts, but holding one out would leave fewer than kto.min_rows = 5 to train on: all of them train.
    rated_file, held = feedback.write_training_data(fb, "kto", tmp_path / "out", min_rows=5)
    assert held is None
    rated, report, pairs = load_rated(str(rated_file))
    assert report.n_usable == 5 and pairs is None  # 1 rating + 2 pairs as one good and one bad answer each
    assert [r["label"] for r in rated] == [True, True, False, True, False]


def test_a_fifth_of_the_prompts_is_held_out_when_there_are_three_or_more():
    """Whole prompts go to the held-out side (a pair's two answers together, for KTO), about a fifth of the rows,
    only when the rows hold 3 prompts or more and the rest still reaches the method's min_rows."""
    rows = [{"prompt": f"p{i}", "completion": c, "label": c == "good"} for i in range(5) for c in ("good", "bad")]
    train, held = feedback.held_out_split(rows, "kto", min_rows=4)
    assert len(held) == 2 and held[0]["prompt"] == held[1]["prompt"]  # round(10 * 0.2) = 2 rows: one prompt
    assert len(train) == 8 and held[0]["prompt"] not in {r["prompt"] for r in train}
    assert feedback.held_out_split(rows, "kto", min_rows=9) == (rows, [])  # 8 left would be too few
    assert feedback.held_out_split(rows[:4], "kto", min_rows=1) == (rows[:4], [])  # 2 prompts: none held out

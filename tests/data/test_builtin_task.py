import random
from collections import Counter
from difflib import SequenceMatcher

from homerlhf.data import builtin


WHOLE_KINDS = {"rude or off-topic", "dressed up", "other topic's fact"}  # whole task sentences, checker says no


def test_pairs_are_preferred_by_construction_with_each_kind_at_its_share():
    for held_out in (False, True):
        pairs = builtin.labelled_pairs(seed=0, n=1000, held_out=held_out)
        for kind, pair in pairs:
            topic = builtin.topic_of(pair["prompt"])
            assert builtin.score_reply(topic, pair["chosen"]) == 1.0 and builtin.well_formed(pair["chosen"])
            if kind in WHOLE_KINDS:
                assert builtin.well_formed(pair["rejected"]) and builtin.score_reply(topic, pair["rejected"]) == -1.0
            else:
                assert not builtin.well_formed(pair["rejected"]), (kind, pair["rejected"])
        counts = Counter(kind for kind, _ in pairs)
        assert set(counts) == set(builtin.REJECTED_KINDS)
        for kind, share in builtin.REJECTED_KINDS.items():  # binomial, n=1000: within 4.5 sd
            assert abs(counts[kind] / 1000 - share) <= 4.5 * (share * (1 - share) / 1000) ** 0.5, (kind, counts[kind])
    assert builtin.preference_records(seed=0, n=50) == [r for _, r in builtin.labelled_pairs(seed=0, n=50)]


def _minimal_pairs(kind, n=200):
    return [r for _, r in builtin.labelled_pairs(seed=3, n=n, kinds={kind: 1.0})]


def _frame(reply):
    opening = next(o for o in builtin.POLITE_OPENINGS if reply.startswith(o))
    return opening, next(f for fs in builtin.TOPICS.values() for f in fs if f in reply)


def test_typos_break_letters_in_the_frame_or_the_fact_of_the_chosen_reply_and_nothing_else():
    for r in _minimal_pairs("typo in the frame"):
        _, fact = _frame(r["chosen"])
        assert fact in r["rejected"] and r["rejected"] != r["chosen"]  # the fact untouched
        assert abs(len(r["rejected"]) - len(r["chosen"])) <= 9  # 1-3 slips of at most 3 letters each
    for r in _minimal_pairs("typo in the fact"):
        opening, fact = _frame(r["chosen"])
        closing = r["chosen"][r["chosen"].index(fact) + len(fact):]  # the frame untouched
        assert r["rejected"].startswith(opening + " ") and r["rejected"].endswith(closing)
        assert r["rejected"] != r["chosen"]
        assert abs(len(r["rejected"]) - len(r["chosen"])) <= 9


def test_corrupt_letters_makes_as_many_small_slips_as_asked():
    rng = random.Random(0)
    text = "Tea is made by steeping dried leaves in hot water."
    for edits in (1, 2, 3):
        for _ in range(100):
            bad = builtin.corrupt_letters(rng, text, edits)
            assert abs(len(bad) - len(text)) <= 3 * edits
            assert SequenceMatcher(None, bad, text).ratio() >= 0.8
    assert builtin.corrupt_letters(random.Random(1), text, 0) == text


def test_cut_jumped_spliced_and_derailed_replies_leave_the_chosen_reply_partway():
    for r in _minimal_pairs("cut"):
        assert r["chosen"].startswith(r["rejected"]) and len(r["rejected"]) < len(r["chosen"])
    for kind in ("jumped", "spliced", "derailed"):
        for r in _minimal_pairs(kind):
            assert r["rejected"][:1] == r["chosen"][:1] and r["rejected"] != r["chosen"], kind
    wrong = _minimal_pairs("other topic's fact")
    assert all(_frame(r["rejected"])[0] == _frame(r["chosen"])[0] for r in wrong)  # same opening, other fact


def test_dressed_up_replies_are_whole_sentences_the_checker_rejects():
    rng = random.Random(0)
    for _ in range(100):
        reply = builtin.dressed_up_reply(rng)
        assert builtin.well_formed(reply) and builtin.score_reply("tea", reply) == -1.0
        assert any(reply.endswith(c) for c in builtin.POLITE_CLOSINGS if c)
        assert any(line in reply for line in builtin.RUDE_REPLIES + builtin.OFF_TOPIC_REPLIES)


def _good_tea_replies() -> set[str]:
    return {
        " ".join(p for p in (opening, fact, closing) if p)
        for opening in builtin.POLITE_OPENINGS for fact in builtin.TOPICS["tea"] for closing in builtin.POLITE_CLOSINGS
    }


def test_ppo_prompts_leave_the_held_out_prompts_out():
    train, held = builtin.split_examples(seed=0)
    prompts = {r["prompt"] for r in builtin.prompt_records()}
    assert prompts == {e.prompt for e in train} and not prompts & {e.prompt for e in held}


def test_held_out_prompts_are_unseen():
    train, held = builtin.split_examples(seed=0)
    assert held and not {e.prompt for e in train} & {e.prompt for e in held}


def test_score_reply_counts_a_fact_cut_by_the_length_cap():
    assert builtin.score_reply("bees", "Sure, good question. Bees dance to tell each other where fl") == 1.0
    assert builtin.score_reply("tea", "Happy to help! Rain falls when water drops in clou") == -1.0
    assert builtin.score_reply("tea", "Ugh, figure it out yourself.") == -1.0
    assert builtin.score_reply("tea", "Gladly! I had a nice walk this morning.") == -1.0


def test_held_out_split_has_at_least_40_prompts():
    train, held = builtin.split_examples(seed=0)
    assert len(held) >= 40 and len(train) + len(held) == len(builtin.TOPICS) * len(builtin.PROMPT_TEMPLATES)


def test_topic_of_finds_the_topic_a_prompt_asks_about():
    assert builtin.topic_of("<s>[user] Tell me about the moon.") == "the moon"
    assert builtin.topic_of("Share a fact about bees.") == "bees"
    assert builtin.topic_of("Hello there.") is None
    assert all(builtin.topic_of(ex.prompt) == ex.topic for ex in builtin.all_examples())


def test_well_formed_accepts_whole_task_sentences_only():
    assert builtin.well_formed("Sure, good question. Tea is made by steeping dried leaves in hot water. I hope that helps.")
    assert builtin.well_formed("Ugh, figure it out yourself.")
    assert builtin.well_formed("Gladly! I had a nice walk this morning.")
    assert not builtin.well_formed("Sure, good question. Tea is made by steeping")  # cut by the cap
    assert not builtin.well_formed("Sure, gASure, good question. Aell each rain gauge meas")  # garbled
    assert not builtin.well_formed("")
    assert not builtin.well_formed("Happy to help! Tea is made by steeping dried leaves in hot water. extra")

import random
import re

from homerlhf.data import builtin


def test_pairs_are_preferred_by_construction():
    for held_out in (False, True):
        pairs = builtin.preference_records(seed=0, n=300, held_out=held_out)
        malformed = 0
        for pair in pairs:
            topic = next(t for t in builtin.TOPICS if re.search(rf"\b{t}\b", pair["prompt"]))
            assert builtin.score_reply(topic, pair["chosen"]) == 1.0 and builtin.well_formed(pair["chosen"])
            if builtin.well_formed(pair["rejected"]):
                assert builtin.score_reply(topic, pair["rejected"]) == -1.0  # rude or off-topic
            else:
                malformed += 1
        assert 105 <= malformed <= 165, malformed  # 45%: a reply cut or garbled, or a garbled fact


def test_malformed_replies_are_cut_or_garbled_good_replies():
    rng = random.Random(0)
    replies = [builtin.malformed_reply(rng, "tea") for _ in range(200)]
    assert not any(builtin.well_formed(r) for r in replies)
    cut = [r for r in replies if any(g.startswith(r) for g in _good_tea_replies())]
    assert 60 <= len(cut) <= 140, len(cut)  # about half are prefixes of a good reply
    assert all(any(r.startswith(o[:2]) for o in builtin.POLITE_OPENINGS) for r in replies)  # they start well


def test_garbled_fact_replies_keep_a_whole_polite_frame_around_a_broken_fact():
    rng = random.Random(0)
    replies = [builtin.garbled_fact_reply(rng, "tea") for _ in range(200)]
    assert not any(builtin.well_formed(r) for r in replies)
    assert all(any(r.startswith(o + " ") for o in builtin.POLITE_OPENINGS) for r in replies)
    # The fact is broken after its first two characters: every reply starts one of the topic's facts.
    assert all(any(f[:2] in r for f in builtin.TOPICS["tea"]) for r in replies)
    spliced = [r for r in replies if any(f[-12:] in r for t, fs in builtin.TOPICS.items() if t != "tea" for f in fs)]
    assert 30 <= len(spliced) <= 110, len(spliced)  # about a third run into another topic's fact


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

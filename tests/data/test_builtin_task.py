import re

from homerlhf.data import builtin


def test_pairs_are_preferred_by_construction():
    for held_out in (False, True):
        for pair in builtin.preference_records(seed=0, n=200, held_out=held_out):
            topic = next(t for t in builtin.TOPICS if re.search(rf"\b{t}\b", pair["prompt"]))
            assert builtin.score_reply(topic, pair["chosen"]) == 1.0
            assert builtin.score_reply(topic, pair["rejected"]) == -1.0


def test_held_out_prompts_are_unseen():
    train, held = builtin.split_examples(seed=0)
    assert held and not {e.prompt for e in train} & {e.prompt for e in held}


def test_score_reply_counts_a_fact_cut_by_the_length_cap():
    assert builtin.score_reply("bees", "Sure, good question. Bees dance to tell each other where fl") == 1.0
    assert builtin.score_reply("tea", "Happy to help! Rain falls when water drops in clou") == -1.0
    assert builtin.score_reply("tea", "Ugh, figure it out yourself.") == -1.0
    assert builtin.score_reply("tea", "Gladly! I had a nice walk this morning.") == -1.0

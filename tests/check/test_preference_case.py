"""homerlhf/check/preference_case.py and the preference cases' sizing (homerlhf/check/cases.py): the pairs the
check writes run every row to ``max_len`` through the stage's own tokenising, the cases run after every
PPO case and ``--only`` picks them, and their estimates price their forwards and backwards on the card.
Their run on the CPU: tests/check/test_main.py (the smoke of every case)."""

from __future__ import annotations

import json

import pytest


@pytest.mark.parametrize("max_len", [48, 1024])
def test_every_row_of_the_pairs_runs_to_max_len(tmp_path, max_len):
    """Each answer half of max_len with its end-of-turn token, exactly; each prompt cut by the stage
    (data.overlong truncate) to within 2 tokens of the rest: a cut inside an ASCII word's characters
    lands a token or two short of the budget at most."""
    from homerlhf.check.preference_case import pairs
    from homerlhf.config import load_config
    from homerlhf.stages.preference_data import load_units, tokenise
    from homerlhf.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    rows = pairs(tokenizer, max_len, 0, 6)
    assert len({r["prompt"] for r in rows}) == 6 and all(r["chosen"] != r["rejected"] for r in rows)
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config("cpu-tiny", overrides=[f"dpo.max_len={max_len}", "data.eval_fraction=0"])
    train, held, reports = load_units("dpo", [str(path)], None, cfg)
    data = tokenise("dpo", train, held, reports, tokenizer, cfg)
    assert len(data.train) == 6 and reports[0].n_truncated == 6 and reports[0].n_dropped == 0
    half = max_len // 2
    for row in data.train:
        assert len(row["chosen_ids"]) == len(row["rejected_ids"]) == half
        assert max_len - half - 2 <= len(row["prompt_ids"]) <= max_len - half


def test_the_preference_cases_run_after_every_ppo_case_and_only_picks_them(tmp_path):
    from homerlhf.check.main import Options, sizing

    every = sizing(Options(out=tmp_path / "r.json"), None, None).todo
    kinds = [c.kind for c in every]
    assert sorted(kinds[-2:]) == ["dpo", "kto"] and not {"dpo", "kto"} & set(kinds[:-2])
    only = sizing(Options(out=tmp_path / "r.json", only="dpo-1.5b,kto-1.5b"), None, None).todo
    assert sorted(c.name for c in only) == ["dpo-1.5b", "kto-1.5b"]
    for case in only:  # at the 4090 preset's settings, shortened to 2 optimizer steps
        assert case.preset == "4090" and case.overrides == (f"{case.kind}.max_steps=2",)
        assert case.estimate_h200_s <= 25 and case.estimate_s > case.estimate_h200_s  # an RTX 4090 is slower


def test_a_preference_cases_work_is_priced_by_flops():
    """DPO at the 4090 preset (4 pairs x 4 accumulated, 1,024 tokens), 2 steps, 8 held-out pairs, on the H200:
    Qwen2.5-1.5B has 28 x (1536 x (1536 + 2 x 256 + 1536) + 3 x 1536 x 8960) + 1536 x 151,936 (its LM head)
    = 1,543,569,408 matmul parameters, 2 FLOPs each a token forward, 6 forward + backward. Trained: 2 x 16
    pairs x 2 rows x 1,024 = 65,536 tokens at 2.38e14 FLOP/s; forwards: the reference's 65,536 and the
    held-out pass's 8 pairs x 2 answers x 2 (before, after) x 1,024 = 32,768 at 3.72e14. KTO: 2 x 16 answers
    = 32,768 tokens trained, 3 forwards of them (the reference, the KL rows under both), and the held-out
    pass also over the 16 answers as rated: 65,536."""
    from homerlhf.check.cases import preference_config, preference_work_s
    from homerlhf.memory.cards import CARDS, MEASURED

    params = 28 * (1536 * (1536 + 2 * 256 + 1536) + 3 * 1536 * 8960) + 1536 * 151_936
    assert params == 1_543_569_408
    dpo = preference_config("4090", "Qwen/Qwen2.5-1.5B", ("dpo.max_steps=2",))
    expected = 65_536 * 6 * params / 2.38e14 + (65_536 + 32_768) * 2 * params / 3.72e14
    assert preference_work_s(dpo, "dpo", "Qwen/Qwen2.5-1.5B", MEASURED) == pytest.approx(expected, rel=1e-9)
    kto = preference_config("4090", "Qwen/Qwen2.5-1.5B", ("kto.max_steps=2",))
    expected = 32_768 * 6 * params / 2.38e14 + (3 * 32_768 + 65_536) * 2 * params / 3.72e14
    assert preference_work_s(kto, "kto", "Qwen/Qwen2.5-1.5B", MEASURED) == pytest.approx(expected, rel=1e-9)
    on_4090 = preference_work_s(kto, "kto", "Qwen/Qwen2.5-1.5B", CARDS["RTX 4090"])
    assert on_4090 == pytest.approx(expected * 989.5 / 165.2, rel=1e-9)  # the cards' published TFLOPS

"""The held-out split of ``homerlhf dpo`` / ``homerlhf kto`` (``data.eval_fraction``, no ``--eval-data``):
by prompt, as the reward stage splits its pairs, so no held-out prompt was trained on. Rows read and
split only: no tokenizer, no model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from homerlhf.config import load_config
from homerlhf.stages.preference_data import load_units

TOPICS = ["tea", "cats", "snow", "maps", "bees", "the moon", "rivers", "bread", "owls", "ice"]


def _write(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _prompt(unit: dict) -> str:
    """The unit's prompt (the loaders make it a message list) as one hashable string."""
    return json.dumps((unit["pair"] if "pair" in unit else unit["rated"])["prompt"], sort_keys=True)


def _pairs() -> list[dict]:
    """10 prompts x 3 distinct pairs each: 30 pairs."""
    return [{"prompt": f"Tell me about {topic}.", "chosen": f"Happy to help! Fact {k} about {topic}.",
             "rejected": f"Go away. Fact {k} about {topic}."} for topic in TOPICS for k in range(3)]


@pytest.mark.parametrize("method", ["dpo", "kto"])
def test_pairs_are_held_out_by_prompt(method, tmp_path):
    source = _write(tmp_path / "pairs.jsonl", _pairs())
    cfg = load_config("cpu-tiny", overrides=["data.eval_fraction=0.3"])
    train, held, _ = load_units(method, [source], None, cfg)
    train_prompts, held_prompts = {_prompt(u) for u in train}, {_prompt(u) for u in held}
    # 30 pairs at 0.3: 9 held out, which is exactly 3 whole prompts of 3 pairs each.
    assert (len(train), len(held)) == (21, 9)
    assert (len(train_prompts), len(held_prompts)) == (7, 3)
    assert train_prompts.isdisjoint(held_prompts)
    chosen = sorted(u["pair"]["chosen"][-1]["content"] for u in train + held)
    assert chosen == sorted(p["chosen"] for p in _pairs())  # each pair once, on one side


def test_rated_answers_are_held_out_by_prompt(tmp_path):
    """KTO's rated answers (a ratings file): 8 prompts x 3 answers (2 good, 1 bad) each."""
    rows = [{"prompt": f"Tell me about {topic}.", "completion": f"Answer {k} about {topic}.", "label": k < 2}
            for topic in TOPICS[:8] for k in range(3)]
    source = _write(tmp_path / "ratings.jsonl", rows)
    cfg = load_config("cpu-tiny", overrides=["data.eval_fraction=0.25"])
    train, held, _ = load_units("kto", [source], None, cfg)
    # 24 answers at 0.25: 6 held out, 2 whole prompts.
    assert (len(train), len(held)) == (18, 6)
    assert {_prompt(u) for u in train}.isdisjoint({_prompt(u) for u in held})
    assert len({_prompt(u) for u in held}) == 2

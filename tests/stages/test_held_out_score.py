"""HeldOutScore: the same seeds for every model, a checkpoint's actor in place of the adapter, and the
reward function's numbers averaged as they came (None as 0)."""

from __future__ import annotations

import json

import pytest
import torch


@pytest.fixture
def scorer_parts(tmp_path, tiny_llama_dir):
    from homerlhf.config import load_config

    prompts = tmp_path / "held.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Reverse: {d}", "answer": d[::-1]}) + "\n"
                               for d in ("1 2 3", "4 5 6", "7 8 9", "3 1 4")))
    rewards = tmp_path / "rewards.py"
    # a reward a test can recompute from the text alone: None for an empty answer, 1 for an even length
    rewards.write_text("def reward(response, row):\n"
                       "    if not response:\n        return None\n"
                       "    return 1.0 if len(response) % 2 == 0 else 0.25\n")
    cfg = load_config("cpu-tiny", overrides=[f"model.name_or_path={tiny_llama_dir}", "ref.backend=adapter_off", "reward.backend=function",
                                             f"reward.function={rewards}:reward", "rollout.max_new_tokens=6",
                                             "algorithm=grpo", "group.size=2"])
    return cfg, str(prompts), f"{rewards}:reward"


def _hand_score(answers):
    values = [0.0 if not a["response"] else (1.0 if len(a["response"]) % 2 == 0 else 0.25) for a in answers]
    return sum(values) / len(values), sum(v == 1.0 for v in values) / len(values)


def test_scores_are_the_reward_functions_own_numbers_and_seeds_repeat(scorer_parts):
    from homerlhf.stages.held_out_score import HeldOutScore

    cfg, prompts, reward = scorer_parts
    scorer = HeldOutScore(cfg, prompts, reward, samples=3)
    first = scorer.score(None, seed=0)
    assert len(first["answers"]) == 12 and [a["prompt"] for a in first["answers"][:4]] == ["Reverse: 1 2 3"] * 3 + [
        "Reverse: 4 5 6"]
    assert (first["score"], first["full"]) == pytest.approx(_hand_score(first["answers"]))
    again, other = scorer.score(None, seed=0), scorer.score(None, seed=1)
    assert [a["response"] for a in again["answers"]] == [a["response"] for a in first["answers"]]
    assert [a["response"] for a in other["answers"]] != [a["response"] for a in first["answers"]]


def test_a_checkpoint_is_scored_with_its_actor_and_the_same_seeds(scorer_parts, tmp_path):
    """A checkpoint holding the untrained actor (LoRA B = 0) answers exactly as the model under the
    adapter; one whose actor moved answers otherwise, from the same seeds."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    from homerlhf.stages.held_out_score import HeldOutScore

    cfg, prompts, reward = scorer_parts
    scorer = HeldOutScore(cfg, prompts, reward, samples=2)
    base = scorer.score(None, seed=0)
    weights = get_peft_model_state_dict(scorer.policy.peft_model_of("actor"), adapter_name="actor")
    untrained, moved = tmp_path / "untrained", tmp_path / "moved"
    for ckpt, scale in ((untrained, 0.0), (moved, 1.0)):
        (ckpt / "actor").mkdir(parents=True)
        generator = torch.Generator().manual_seed(0)
        save_file({k: (v + scale * torch.randn(v.shape, generator=generator) if "lora_B" in k else v).contiguous()
                   for k, v in weights.items()}, str(ckpt / "actor" / "adapter_model.safetensors"))
    assert [a["response"] for a in scorer.score(untrained, seed=0)["answers"]] == [a["response"] for a in base["answers"]]
    moved_answers = scorer.score(moved, seed=0)["answers"]
    assert [a["response"] for a in moved_answers] != [a["response"] for a in base["answers"]]

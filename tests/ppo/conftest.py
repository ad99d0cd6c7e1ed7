"""What the trainer and update tests share: the tiny CPU config and tokenised builtin prompts (the
peaked tiny policy of the learning tests is in the top-level conftest: the engine's uses it too)."""

from __future__ import annotations

import pytest


@pytest.fixture
def ppo_cfg():
    """``ppo_cfg(*overrides)``: the cpu-tiny config with the adapter-off reference and an HF reward.

    The KL, truncation and actor settings are pinned to a fixed ``kl_coef`` 0.02, no truncation
    penalty and ``actor.lr`` 2e-3 (what these tests' figures were measured with), not the demo
    recipe of the preset: the tests cap responses at a few tokens, which the preset's penalty would
    score all alike."""
    from homerlhf.config import load_config

    def make(*extra):
        return load_config("cpu-tiny", overrides=[
            "ref.backend=adapter_off", "reward.backend=hf", "logging.progress=false", "ppo.kl_coef=0.02",
            "ppo.adaptive_kl=false", "rollout.truncation_penalty=null", "actor.lr=2e-3", *extra])

    return make


@pytest.fixture
def prompt_ids():
    """``prompt_ids(tokenizer, n)``: the first ``n`` builtin prompts, chat-templated token ids."""
    from homerlhf.data.builtin import all_examples

    def make(tokenizer, n):
        out = []
        for example in all_examples()[:n]:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": example.prompt}],
                                                add_generation_prompt=True, tokenize=True)
            out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
        return out

    return make

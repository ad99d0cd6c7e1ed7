"""What the trainer and update tests share: the tiny CPU config and tokenised builtin prompts (the
peaked tiny policy of the learning tests is in the top-level conftest: the engine's uses it too)."""

from __future__ import annotations

import pytest


@pytest.fixture
def ppo_cfg():
    """``ppo_cfg(*overrides)``: the cpu-tiny config with the adapter-off reference and an HF reward."""
    from homerlhf.config import load_config

    def make(*extra):
        return load_config("cpu-tiny", overrides=[
            "ref.backend=adapter_off", "reward.backend=hf", "logging.progress=false", *extra])

    return make


@pytest.fixture
def prompt_ids():
    """``prompt_ids(tokenizer, n)``: the first ``n`` builtin prompts, chat-templated token ids."""
    from homerlhf.data.builtin import prompt_records

    def make(tokenizer, n):
        out = []
        for record in prompt_records()[:n]:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": record["prompt"]}],
                                                add_generation_prompt=True, tokenize=True)
            out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
        return out

    return make

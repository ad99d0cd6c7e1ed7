"""What the trainer and update tests share: the tiny CPU config, tokenised builtin prompts and a
peaked tiny policy for the learning tests."""

from __future__ import annotations

import pytest
import torch


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


@pytest.fixture(scope="module")
def peaked_policy_dir(tmp_path_factory):
    """A tiny Llama whose LM head is scaled up: a random model with a peaked next-token
    distribution (entropy ~3 nats instead of ln 512), like a trained LM, so a reward on one
    token has signal from the start."""
    from transformers import AutoModelForCausalLM

    from homerlhf.tiny import build_tokenizer, model_config

    tok = build_tokenizer()
    config = model_config("llama", len(tok), hidden=64, layers=2)
    config.pad_token_id, config.eos_token_id, config.bos_token_id = tok.pad_token_id, tok.eos_token_id, tok.bos_token_id
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    out = tmp_path_factory.mktemp("peaked-llama")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out

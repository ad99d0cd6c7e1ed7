"""The demo models, registered by ``homerlhf.stages.builtin`` and built by the SFT stage."""

from __future__ import annotations

import pytest

import homerlhf.stages  # noqa: F401 - what registers the demo models
from homerlhf.models.registry import builtin_names, resolve_model


def test_importing_the_stages_registers_the_demo_models_after_the_tiny_ones():
    assert builtin_names() == ["builtin:tiny-llama", "builtin:tiny-qwen2", "builtin:demo-sft", "builtin:demo-rm"]


@pytest.mark.slow
def test_demo_sft_replies_like_the_builtin_task():
    """builtin:demo-sft has learned the task's replies: sampled completions are builtin replies."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from homerlhf.data import builtin
    from homerlhf.data.tokens import tokenize_prompts

    path = resolve_model("builtin:demo-sft")
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    _, held = builtin.split_examples()
    prompts = [{"prompt": [{"role": "user", "content": ex.prompt}]} for ex in held[:8]]
    ids = tokenize_prompts(prompts, tok, 48)
    known = set(builtin.RUDE_REPLIES) | set(builtin.OFF_TOPIC_REPLIES) | {f for facts in builtin.TOPICS.values() for f in facts}
    hits = 0
    torch.manual_seed(0)
    for p in ids:
        out = model.generate(torch.tensor([p]), max_new_tokens=40, do_sample=False)
        reply = tok.decode(out[0, len(p):], skip_special_tokens=True)
        hits += any(k in reply for k in known)
    assert hits >= 6, hits

"""``resolve_model``: builtin names built once into the cache, everything else passed through."""

from __future__ import annotations

import os

import pytest

from homerlhf.errors import UserError
from homerlhf.stages.builtin import cache_key, resolve_model


def test_tiny_models_are_built_once_and_cached():
    from transformers import AutoConfig

    path = resolve_model("builtin:tiny-qwen2")
    assert os.path.basename(path) == cache_key("tiny-qwen2")
    assert AutoConfig.from_pretrained(path).model_type == "qwen2"
    mtime = os.path.getmtime(os.path.join(path, "model.safetensors"))
    assert resolve_model("builtin:tiny-qwen2") == path
    assert os.path.getmtime(os.path.join(path, "model.safetensors")) == mtime
    # nothing half-built is left next to it
    assert not [p for p in os.listdir(os.path.dirname(path)) if p.startswith(".tmp-")]


def test_other_names_pass_through(tmp_path):
    assert resolve_model("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    assert resolve_model(str(tmp_path)) == str(tmp_path)


@pytest.mark.parametrize("bad, fragment", [
    ("builtin:nope", "unknown builtin model 'builtin:nope'"),
    ("./no/such/dir", "does not exist"),
    ("/no/such/model.gguf", "does not exist"),
])
def test_bad_names_are_one_line_errors(bad, fragment):
    with pytest.raises(UserError, match=fragment) as err:
        resolve_model(bad)
    assert "\n" not in str(err.value)


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

"""The demo models, registered by ``homerlhf.stages.builtin`` and built by the SFT stage."""

from __future__ import annotations

import pytest

import homerlhf.stages  # noqa: F401 - what registers the demo models
from homerlhf.models.registry import builtin_names, resolve_model


def test_importing_the_stages_registers_the_demo_models_after_the_registrys_own():
    assert builtin_names() == ["builtin:tiny-llama", "builtin:tiny-qwen2", "builtin:gemma3-270m", "builtin:demo-sft",
                               "builtin:demo-rm", "builtin:reverse-sft"]


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


@pytest.mark.slow
def test_reverse_sft_is_right_sometimes_so_rl_has_room_and_a_signal():
    """builtin:reverse-sft answers with digits, right on part of the held-out strings but far from all,
    and its sampled answers to one training string are sometimes right, sometimes wrong (what GRPO needs)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from homerlhf.data import builtin_reverse

    path = resolve_model("builtin:reverse-sft")
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path, padding_side="left")

    def answers(rows, sample: bool, n: int = 1) -> list[list[str]]:
        texts = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=False,
                                         add_generation_prompt=True) for r in rows]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=12, do_sample=sample, temperature=1.0, top_k=0, top_p=1.0,
                                 num_return_sequences=n, pad_token_id=tok.pad_token_id)
        replies = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        return [replies[i * n:(i + 1) * n] for i in range(len(rows))]

    held = builtin_reverse.prompt_records(held_out=True)
    greedy = [a[0] for a in answers(held, sample=False)]
    digits = [a.strip().removeprefix(builtin_reverse.PREFIX).replace(" ", "") for a in greedy]
    assert sum(d.isdigit() for d in digits) >= 0.9 * len(held)
    # Half the SFT answers carry the "Reversed:" prefix the checker refuses, so the build answers in
    # both styles; what RL trains on is the temperature-1 samples, right on part of the held-out
    # strings only (measured 20% in the demo, NF4).
    assert 0 < sum(not builtin_reverse.in_checked_style(a) for a in greedy) < len(held)
    torch.manual_seed(0)
    sampled = [a for group in answers(held, True, 4) for a in group]
    truth = [r["answer"] for r in held for _ in range(4)]
    right = sum(builtin_reverse.check(a, t) for a, t in zip(sampled, truth))
    assert 0.1 * len(sampled) < right < 0.9 * len(sampled), right

    torch.manual_seed(0)
    train = builtin_reverse.prompt_records()[:32]
    groups = [[builtin_reverse.check(a, r["answer"]) for a in group] for group, r in zip(answers(train, True, 8), train)]
    assert sum(0 < sum(g) < len(g) for g in groups) >= 8, groups


def test_each_task_build_is_keyed_by_its_own_task_file_not_the_other_tasks():
    """An edit to the reversal task rebuilds reverse-sft only. (The demo task's file also holds the corpus
    the tiny tokenizer learns, so every build, reverse-sft's too, is keyed by it.)"""
    from homerlhf.stages.builtin import _recipe_files

    demo = {(f.parent.name, f.name) for f in _recipe_files(rm=True)}
    reverse = {(f.parent.name, f.name) for f in _recipe_files(rm=False, task="reverse")}
    assert ("data", "builtin.py") in demo and ("data", "builtin_reverse.py") not in demo
    assert ("data", "builtin_reverse.py") in reverse
    assert {("data", "read.py"), ("data", "load.py"), ("stages", "sft.py")} <= demo & reverse
    assert ("stages", "reward.py") in demo - reverse

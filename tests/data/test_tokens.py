"""Tokenising records: chat template, over-long prompts cut inside their last user message (real\nQwen3, Llama-3.1 and Gemma-3 tokenizers) or dropped, the over-long policy."""

from __future__ import annotations

import pytest

from homerlhf.data.load import LoadReport
from homerlhf.data.tokens import fit_length, fit_prompt, prompt_ids, render, tokenize_prompts
from homerlhf.errors import UserError


def user(text):
    return {"role": "user", "content": text}


@pytest.fixture(scope="module")
def tokenizer():
    from homerlhf.tiny import build_tokenizer

    return build_tokenizer()


def test_tokenize_prompts_uses_chat_template_and_cuts_inside_the_user_message(tokenizer):
    records = [{"prompt": [user("Tell me about tea.")]}, {"prompt": [user("Tell me about tea. " * 10)]}]
    full = tokenizer.apply_chat_template(records[0]["prompt"], add_generation_prompt=True, tokenize=False)
    assert full == "<|user|>Tell me about tea.<|end|><|assistant|>"
    report = LoadReport(source="s", kind="prompt", n_rows=2, n_usable=2)
    ids = tokenize_prompts(records, tokenizer, max_prompt_len=12, report=report)
    assert ids[0] == tokenizer(full, add_special_tokens=False)["input_ids"]
    assert len(ids[1]) <= 12 and (report.n_truncated, report.n_dropped, report.n_usable) == (1, 0, 2)
    # The message lost its end, not its tags: the user tag opens, the generation prompt closes.
    text = tokenizer.decode(ids[1])
    assert text.startswith("<|user|>Tell me") and text.endswith("<|end|><|assistant|>")
    report = LoadReport(source="s", kind="prompt", n_rows=2, n_usable=2)
    assert tokenize_prompts(records, tokenizer, 12, overlong="drop", report=report) == [ids[0]]
    assert (report.n_dropped, report.n_usable) == (1, 1)


SYSTEM = "You are a terse pirate who answers in one line."
LONG = ("Tell me everything about the sea, the ships and the stars above them. " * 40).strip()


def _real_tokenizer(real_tokenizer_dirs, name):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(real_tokenizer_dirs[name])


@pytest.mark.parametrize("name", ["qwen3", "llama3_1", "gemma3"])
def test_an_overlong_prompt_keeps_bos_system_turn_and_generation_prompt(real_tokenizer_dirs, name):
    tok = _real_tokenizer(real_tokenizer_dirs, name)
    prompt = [{"role": "system", "content": SYSTEM}, user("Hi"), {"role": "assistant", "content": "Arr."}, user(LONG)]
    full_text = render(tok, prompt, add_generation_prompt=True)
    full_ids = prompt_ids(tok, prompt)
    # The rendering around the last user content: BOS, system turn, earlier turns, its own tags before;
    # its end-of-turn and the generation prompt after.
    head, tail = full_text[: full_text.index(LONG)], full_text[full_text.index(LONG) + len(LONG):]
    assert SYSTEM in head and tail
    limit = 80
    assert len(full_ids) > 3 * limit
    report = LoadReport(source="s", kind="prompt", n_rows=1, n_usable=1)
    [ids] = tokenize_prompts([{"prompt": prompt}], tok, limit, report=report)
    assert len(ids) <= limit and (report.n_truncated, report.n_dropped) == (1, 0)
    assert ids[: len(tok(head, add_special_tokens=False)["input_ids"])] == tok(head, add_special_tokens=False)["input_ids"]
    if tok.bos_token_id is not None:  # Llama-3.1, Gemma-3
        assert ids[0] == tok.bos_token_id == full_ids[0]
    text = tok.decode(ids, clean_up_tokenization_spaces=False)
    assert text.startswith(head) and text.endswith(tail)
    kept = text[len(head): len(text) - len(tail)]
    assert LONG.startswith(kept) and len(kept) > len(LONG) // 20  # the message's head, most of what fits
    # Nearly all of the budget is used: one more word would not fit.
    longer = prompt[:-1] + [user(LONG[: len(kept) + len(" everything")])]
    assert len(prompt_ids(tok, longer)) > limit - 4


@pytest.mark.parametrize("name", ["qwen3", "llama3_1", "gemma3"])
def test_a_prompt_whose_other_turns_are_too_long_is_dropped_and_counted(real_tokenizer_dirs, name):
    tok = _real_tokenizer(real_tokenizer_dirs, name)
    fits = [{"role": "system", "content": SYSTEM}, user("Hi")]
    too_long = [{"role": "system", "content": LONG}, user("Hi")]  # the system turn alone exceeds the limit
    assert fit_prompt(tok, too_long, 60) is None
    report = LoadReport(source="s", kind="prompt", n_rows=2, n_usable=2)
    ids = tokenize_prompts([{"prompt": too_long}, {"prompt": fits}], tok, 60, report=report)
    assert ids == [prompt_ids(tok, fits)]
    assert (report.n_dropped, report.n_truncated, report.n_usable) == (1, 0, 1)
    assert "1 dropped as too long" in report.summary()
    with pytest.raises(UserError, match="no prompt of s fits rollout.max_prompt_len=60"):
        tokenize_prompts([{"prompt": too_long}], tok, 60, report=LoadReport(source="s", kind="prompt"))


def test_fit_length_truncate_and_drop():
    records = [{"prompt": [user(str(i))]} for i in range(4)]
    report = LoadReport(source="s", kind="prompt", n_rows=4, n_usable=4)
    kept = fit_length(records, [3, 10, 5, 11], 5, "truncate", report)
    assert kept == records and report.n_truncated == 2 and report.n_dropped == 0
    report = LoadReport(source="s", kind="prompt", n_rows=4, n_usable=4)
    kept = fit_length(records, [3, 10, 5, 11], 5, "drop", report)
    assert kept == [records[0], records[2]] and report.n_dropped == 2 and report.n_usable == 2
    assert "2 dropped as too long" in report.summary()
    with pytest.raises(UserError, match="longer than 2 tokens"):
        fit_length(records, [3, 10, 5, 11], 2, "drop", LoadReport(source="s", kind="prompt"))

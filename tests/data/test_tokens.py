"""Tokenising records: chat template, left truncation of prompts, the over-long policy."""

from __future__ import annotations

import pytest

from homerlhf.data.load import LoadReport
from homerlhf.data.tokens import fit_length, tokenize_prompts
from homerlhf.errors import UserError


def user(text):
    return {"role": "user", "content": text}


@pytest.fixture(scope="module")
def tokenizer():
    from homerlhf.tiny import build_tokenizer

    return build_tokenizer()


def test_tokenize_prompts_uses_chat_template_and_left_truncates(tokenizer):
    records = [{"prompt": [user("Tell me about tea.")]}, {"prompt": [user("Tell me about tea. " * 10)]}]
    full = tokenizer.apply_chat_template(records[0]["prompt"], add_generation_prompt=True, tokenize=False)
    assert full == "<|user|>Tell me about tea.<|end|><|assistant|>"
    ids = tokenize_prompts(records, tokenizer, max_prompt_len=12)
    assert ids[0] == tokenizer(full, add_special_tokens=False)["input_ids"]
    assert len(ids[1]) == 12
    # Left truncation keeps the end: the generation prompt is the last token.
    assert ids[1][-1] == tokenizer.convert_tokens_to_ids("<|assistant|>")
    report = LoadReport(source="s", kind="prompt", n_rows=2, n_usable=2)
    assert tokenize_prompts(records, tokenizer, 12, overlong="drop", report=report) == [ids[0]]
    assert (report.n_dropped, report.n_usable) == (1, 1)


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

"""Tokenisation: records rendered with the model's chat template, encoded, and fitted to a length.

Token ids are made here once, for every stage: the prompts PPO generates from, the whole dialogues
SFT and the reward model train on.
"""

from __future__ import annotations

from typing import Literal, Optional, Sequence

from homerlhf.data.formats import Message, Record
from homerlhf.data.load import LoadReport
from homerlhf.errors import UserError


def render(tokenizer, messages: list[Message], add_generation_prompt: bool = False) -> str:
    """Messages as the model's text: its chat template, or plain turns for a base model without one."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    if len(messages) == 1 and messages[0]["role"] == "user" and add_generation_prompt:
        return messages[0]["content"] + "\n"
    text = "".join(
        f"\n\n{'Human' if m['role'] == 'user' else m['role'].capitalize()}: {m['content']}" for m in messages
    ).lstrip("\n")
    return text + ("\n\nAssistant:" if add_generation_prompt else "")


def encode(tokenizer, text: str) -> list[int]:
    # Chat templates already hold the special tokens they need.
    return tokenizer(text, add_special_tokens=not getattr(tokenizer, "chat_template", None))["input_ids"]


def prompt_ids(tokenizer, prompt: list[Message]) -> list[int]:
    return encode(tokenizer, render(tokenizer, prompt, add_generation_prompt=True))


def tokenize_prompts(
    records: Sequence[Record],
    tokenizer,
    max_prompt_len: int,
    *,
    overlong: Literal["truncate", "drop"] = "truncate",
    report: Optional[LoadReport] = None,
) -> list[list[int]]:
    """Prompt records -> token ids ready for generation, each left-truncated to ``max_prompt_len``.

    Left truncation keeps the end of the prompt (the latest user turn and the generation prompt),
    which is what the reply must follow. Returns one list of ints per kept record (no padding);
    with ``overlong="drop"`` longer prompts are left out. ``report`` (if given) counts both.
    """
    all_ids = [prompt_ids(tokenizer, r["prompt"]) for r in records]
    if report is not None:
        fit_length(list(range(len(all_ids))), [len(i) for i in all_ids], max_prompt_len, overlong, report)
    if overlong == "drop":
        return [ids for ids in all_ids if len(ids) <= max_prompt_len]
    return [ids[-max_prompt_len:] for ids in all_ids]


def sequence_ids(tokenizer, prompt: list[Message], reply: list[Message]) -> list[int]:
    """Token ids of prompt + reply as the model sees a whole dialogue (ends with the eos/turn end)."""
    ids = encode(tokenizer, render(tokenizer, prompt + reply))
    eos = tokenizer.eos_token_id
    if eos is not None and (not ids or ids[-1] != eos) and not getattr(tokenizer, "chat_template", None):
        ids = ids + [eos]
    return ids


def fit_length(
    records: list[Record],
    lengths: Sequence[int],
    max_len: int,
    overlong: Literal["truncate", "drop"],
    report: LoadReport,
) -> list[Record]:
    """Apply the over-long policy: count rows longer than ``max_len`` tokens, drop them if asked.

    Truncation itself happens where the tokens are made (left for prompts and reward pairs, on
    the completion's end for SFT); this only decides and counts.
    """
    kept = []
    for record, n in zip(records, lengths):
        if n <= max_len:
            kept.append(record)
        elif overlong == "drop":
            report.n_dropped += 1
        else:
            report.n_truncated += 1
            kept.append(record)
    report.n_usable = len(kept)
    if not kept:
        raise UserError(
            f"every row of {report.source} is longer than {max_len} tokens and data.overlong is 'drop'; "
            "raise the max length or use data.overlong=truncate"
        )
    return kept

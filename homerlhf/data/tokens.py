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


def fit_prompt(tokenizer, prompt: list[Message], max_len: int) -> Optional[list[int]]:
    """Ids of ``prompt`` with its generation prompt, at most ``max_len`` of them; None if it cannot fit.

    An over-long prompt is cut inside the content of its last user message, never in the rendered
    ids: the message keeps its head (the longest prefix that fits, found by a binary search over
    its characters, each candidate rendered again), so BOS, the system turn, earlier turns, the
    message's own tags and the generation prompt all survive. The head is kept because a request
    usually says what it wants first ("Summarise this:", "Translate:", a question before pasted
    text). None when even an empty last user message (or a prompt without one) is too long.
    """
    ids = prompt_ids(tokenizer, prompt)
    if len(ids) <= max_len:
        return ids
    last = max((i for i, m in enumerate(prompt) if m["role"] == "user"), default=None)
    if last is None:
        return None
    content = prompt[last]["content"]

    def with_head(n_chars: int) -> list[int]:
        cut = {**prompt[last], "content": content[:n_chars]}
        return prompt_ids(tokenizer, [*prompt[:last], cut, *prompt[last + 1:]])

    best = with_head(0)
    if len(best) > max_len:
        return None
    fits, too_long = 0, len(content)  # invariant: with_head(fits) fits, with_head(too_long) does not
    while too_long - fits > 1:
        mid = (fits + too_long) // 2
        candidate = with_head(mid)
        if len(candidate) <= max_len:
            fits, best = mid, candidate
        else:
            too_long = mid
    return best


def tokenize_prompts(
    records: Sequence[Record],
    tokenizer,
    max_prompt_len: int,
    *,
    overlong: Literal["truncate", "drop"] = "truncate",
    report: Optional[LoadReport] = None,
) -> list[list[int]]:
    """Prompt records -> token ids ready for generation, each at most ``max_prompt_len`` long.

    ``overlong="truncate"`` cuts an over-long prompt inside its last user message
    (:func:`fit_prompt`) and drops the prompts that cannot fit even so; ``"drop"`` drops every
    over-long prompt. Returns one list of ints per kept record (no padding); ``report`` (if given)
    counts the cut (``n_truncated``) and dropped (``n_dropped``) ones. No prompt left is a UserError.
    """
    return [ids for _, ids in tokenize_prompts_indexed(records, tokenizer, max_prompt_len, overlong=overlong,
                                                       report=report)]


def tokenize_prompts_indexed(
    records: Sequence[Record],
    tokenizer,
    max_prompt_len: int,
    *,
    overlong: Literal["truncate", "drop"] = "truncate",
    report: Optional[LoadReport] = None,
) -> list[tuple[int, list[int]]]:
    """:func:`tokenize_prompts` with each kept prompt's index in ``records``: ``(index, ids)``."""
    report = report if report is not None else LoadReport(source="prompts", kind="prompt", n_rows=len(records))
    kept = []
    for index, record in enumerate(records):
        ids = prompt_ids(tokenizer, record["prompt"])
        if len(ids) > max_prompt_len:
            ids = fit_prompt(tokenizer, record["prompt"], max_prompt_len) if overlong == "truncate" else None
            if ids is None:
                report.n_dropped += 1
                continue
            report.n_truncated += 1
        kept.append((index, ids))
    report.n_usable = len(kept)
    if not kept:
        raise UserError(
            f"no prompt of {report.source} fits rollout.max_prompt_len={max_prompt_len} tokens "
            f"(data.overlong={overlong}); raise rollout.max_prompt_len"
            + (" or use data.overlong=truncate" if overlong == "drop" else "")
        )
    return kept


def fit_length(
    records: list[Record],
    lengths: Sequence[int],
    max_len: int,
    overlong: Literal["truncate", "drop"],
    report: LoadReport,
) -> list[Record]:
    """Apply the over-long policy: count rows longer than ``max_len`` tokens, drop them if asked.

    Truncation itself happens where the tokens are made (inside the prompt's last user message for
    reward pairs, on the completion's end for SFT); this only decides and counts. PPO prompts have their own:
    :func:`tokenize_prompts`.
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

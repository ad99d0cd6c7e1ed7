"""Format converters: one raw row -> one normalised record, whatever the dataset's format.

Normalised records keep every turn as a chat message (``{"role", "content"}``), so the model's
own tokenizer renders them (``apply_chat_template``):

- prompt record:      ``{"prompt": [msg, ..., user msg]}``
- SFT record:         ``{"prompt": [msg, ...], "completion": [assistant msg, ...]}``
- preference record:  ``{"prompt": [msg, ...], "chosen": [assistant msg, ...], "rejected": [...]}``

:func:`prompt_converter`, :func:`sft_converter` and :func:`preference_converter` (their docstrings list
the formats recognised; ``cfg.data.*_column`` names the columns) pick the format from the column names
once and return ``(format name, convert)``; ``convert(row)`` raises :class:`BadRow` for a row it cannot use.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

from homerlhf.errors import UserError

Message = dict[str, str]
Record = dict[str, list[Message]]

ROLE_ALIASES = {
    "user": "user", "human": "user", "prompter": "user",
    "assistant": "assistant", "gpt": "assistant", "bot": "assistant", "model": "assistant", "chatgpt": "assistant",
    "system": "system",
}
HH_TURN = re.compile(r"\n\n(Human|Assistant):[ \t]?")


class BadRow(ValueError):
    """Why one row cannot be used; the loader counts it and goes on."""


@dataclass(frozen=True)
class Columns:
    """User overrides of column names (``cfg.data.*_column``); None = detect."""

    prompt: Optional[str] = None
    chosen: Optional[str] = None
    rejected: Optional[str] = None
    messages: Optional[str] = None

    @classmethod
    def from_config(cls, data_cfg) -> "Columns":
        return cls(data_cfg.prompt_column, data_cfg.chosen_column, data_cfg.rejected_column, data_cfg.messages_column)


# ---------------------------------------------------------------------------- field conversion


def _text(value: Any, what: str) -> str:
    if value is None:
        raise BadRow(f"missing {what}")
    if not isinstance(value, str):
        raise BadRow(f"{what} should be text, got {type(value).__name__}")
    if not value.strip():
        raise BadRow(f"empty {what}")
    return value


def _maybe_json(value: Any) -> Any:
    # CSV cells and some exports hold message lists as JSON strings.
    if isinstance(value, str) and value.lstrip()[:1] in ("[", "{"):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            return value
        if isinstance(parsed, dict) or (isinstance(parsed, list) and all(isinstance(m, dict) for m in parsed)):
            return parsed
    return value


def _message(value: Any, what: str) -> Message:
    if not isinstance(value, dict):
        raise BadRow(f"{what} should be a message object, got {type(value).__name__}")
    role = value.get("role", value.get("from"))
    content = value.get("content", value.get("value"))
    if not isinstance(role, str) or role.lower() not in ROLE_ALIASES:
        raise BadRow(f"{what} has unknown role {role!r}")
    if isinstance(content, list):  # multimodal-style [{"type": "text", "text": ...}]
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return {"role": ROLE_ALIASES[role.lower()], "content": _text(content, f"{what} content")}


def _messages(value: Any, what: str) -> list[Message]:
    value = _maybe_json(value)
    if value is None:
        raise BadRow(f"missing {what}")
    if not isinstance(value, list):
        raise BadRow(f"{what} should be a list of messages, got {type(value).__name__}")
    if not value:
        raise BadRow(f"empty {what}")
    return [_message(m, f"{what}[{i}]") for i, m in enumerate(value)]


def _as_messages(value: Any, what: str, role: str) -> list[Message]:
    """Text -> one message with ``role``; a message or list of messages -> normalised messages."""
    value = _maybe_json(value)
    if isinstance(value, dict):
        return [_message(value, what)]
    if isinstance(value, list):
        return _messages(value, what)
    return [{"role": role, "content": _text(value, what)}]


def parse_hh(text: str) -> list[Message]:
    """Anthropic HH text (``\\n\\nHuman: a\\n\\nAssistant: b``) -> messages; [] if not that style."""
    if not text.startswith("\n\n"):
        text = "\n\n" + text
    parts = HH_TURN.split(text)
    if len(parts) < 3 or parts[0].strip():
        return []
    roles, contents = parts[1::2], parts[2::2]
    return [{"role": "user" if r == "Human" else "assistant", "content": c.strip()} for r, c in zip(roles, contents)]


def _split_shared_prefix(chosen: list[Message], rejected: list[Message]) -> tuple[list[Message], list[Message], list[Message]]:
    n = 0
    while n < min(len(chosen), len(rejected)) - 1 and chosen[n] == rejected[n]:
        n += 1
    prompt, chosen_tail, rejected_tail = chosen[:n], chosen[n:], rejected[n:]
    if not prompt or prompt[-1]["role"] != "user":
        raise BadRow("chosen and rejected share no prompt that ends in a user turn")
    if chosen_tail[0]["role"] != "assistant" or rejected_tail[0]["role"] != "assistant":
        raise BadRow("chosen and rejected must continue the shared prompt with an assistant turn")
    return prompt, chosen_tail, rejected_tail


def _check_prompt(prompt: list[Message]) -> list[Message]:
    while prompt and prompt[-1]["role"] == "assistant":
        prompt = prompt[:-1]  # a full dialogue used as a prompt: drop the reply
    if not prompt or prompt[-1]["role"] != "user":
        raise BadRow("prompt has no user turn")
    return prompt


# ------------------------------------------------------------------------------ row converters


def _find(columns: Iterable[str], *names: Optional[str]) -> Optional[str]:
    present = set(columns)
    return next((n for n in names if n and n in present), None)


def preference_converter(columns: Sequence[str], cols: Columns) -> tuple[str, Callable[[dict], Record]]:
    """``prompt``/``chosen``/``rejected`` as text; ``chosen``/``rejected`` full dialogues with a shared prefix,
    as text (Anthropic HH ``\n\nHuman: ... \n\nAssistant: ...``) or as message lists (UltraFeedback-binarized);
    ShareGPT ``conversations`` (``from``/``value``) with ``chosen``/``rejected`` replies (LLaMA-Factory style)."""
    chosen = _find(columns, cols.chosen, "chosen")
    rejected = _find(columns, cols.rejected, "rejected")
    if not chosen or not rejected:
        raise UserError(
            f"no chosen/rejected columns among {sorted(columns)}; "
            "set data.chosen_column and data.rejected_column"
        )
    convs = _find(columns, cols.messages, "conversations", "messages")
    prompt = _find(columns, cols.prompt, "prompt", "question", "instruction")

    if convs and not cols.prompt:
        def conv(row: dict) -> Record:
            p = _check_prompt(_messages(row.get(convs), convs))
            return {"prompt": p, "chosen": _as_messages(row.get(chosen), chosen, "assistant"),
                    "rejected": _as_messages(row.get(rejected), rejected, "assistant")}

        return f"sharegpt preference ({convs} + {chosen}/{rejected})", conv

    def dialogues(row: dict) -> Record:
        c, r = _maybe_json(row.get(chosen)), _maybe_json(row.get(rejected))
        if isinstance(c, list) and isinstance(r, list):
            cm, rm = _messages(c, chosen), _messages(r, rejected)
        elif isinstance(c, str) and isinstance(r, str) and not (prompt and row.get(prompt) is not None):
            cm, rm = parse_hh(_text(c, chosen)), parse_hh(_text(r, rejected))
            if not cm or not rm:
                raise BadRow(f"{chosen}/{rejected} are plain text without a prompt; set data.prompt_column")
        else:
            cm = _as_messages(c, chosen, "assistant")
            rm = _as_messages(r, rejected, "assistant")
            if not prompt:
                raise BadRow(f"{chosen}/{rejected} are replies without a prompt; set data.prompt_column")
            p = _check_prompt(_as_messages(row.get(prompt), prompt, "user"))
            return {"prompt": p, "chosen": cm, "rejected": rm}
        if prompt and cm[0]["role"] == "assistant":  # full replies as lists, prompt in its own column
            return {"prompt": _check_prompt(_as_messages(row.get(prompt), prompt, "user")), "chosen": cm, "rejected": rm}
        p, cm, rm = _split_shared_prefix(cm, rm)
        return {"prompt": p, "chosen": cm, "rejected": rm}

    first_kind = "prompt/chosen/rejected" if prompt else "chosen/rejected dialogues"
    return first_kind, dialogues


def prompt_converter(columns: Sequence[str], cols: Columns) -> tuple[str, Callable[[dict], list[Message]]]:
    """``prompt`` (text or messages), ``question``, ``instruction`` (+ ``input``), a ``messages`` list
    (trailing assistant turns are dropped), ShareGPT ``conversations``."""
    if cols.prompt and cols.prompt in columns:
        return f"prompt ({cols.prompt})", lambda row: _check_prompt(_as_messages(row.get(cols.prompt), cols.prompt, "user"))
    if cols.prompt:
        raise UserError(f"data.prompt_column '{cols.prompt}' is not a column; columns are {sorted(columns)}")
    msgs = _find(columns, cols.messages, "messages", "conversations")
    if msgs:
        return f"messages ({msgs})", lambda row: _check_prompt(_messages(row.get(msgs), msgs))
    if "prompt" in columns:
        return "prompt", lambda row: _check_prompt(_as_messages(row.get("prompt"), "prompt", "user"))
    if "question" in columns:
        return "question", lambda row: [{"role": "user", "content": _text(row.get("question"), "question")}]
    if "instruction" in columns:
        return "instruction/input", lambda row: [{"role": "user", "content": _instruction(row)}]
    if "chosen" in columns and "rejected" in columns:
        fmt, pref = preference_converter(columns, cols)
        return f"{fmt} (prompts)", lambda row: pref(row)["prompt"]
    raise UserError(
        f"cannot find prompts among columns {sorted(columns)}; "
        "set data.prompt_column (or data.messages_column)"
    )


def _instruction(row: dict) -> str:
    text = _text(row.get("instruction"), "instruction")
    extra = row.get("input")
    if extra is not None and not isinstance(extra, str):
        raise BadRow(f"input should be text, got {type(extra).__name__}")
    return f"{text}\n\n{extra}" if extra and extra.strip() else text


def sft_converter(columns: Sequence[str], cols: Columns) -> tuple[str, Callable[[dict], Record]]:
    """``prompt``/``completion`` (or ``response``/``output``/``answer``), ``instruction`` + ``input`` +
    ``output`` (Alpaca), ``messages`` or ``conversations`` ending in an assistant turn."""
    reply = _find(columns, cols.chosen, "completion", "response", "output", "answer")
    msgs = _find(columns, cols.messages, "messages", "conversations")
    if not reply and not msgs and "chosen" in columns and "rejected" in columns:
        fmt, pref = preference_converter(columns, cols)
        return f"{fmt} (chosen as completion)", lambda row: (lambda r: {"prompt": r["prompt"], "completion": r["chosen"]})(pref(row))
    if msgs and not (cols.prompt or cols.chosen):
        def dialogue(row: dict) -> Record:
            m = _messages(row.get(msgs), msgs)
            cut = len(m)
            while cut and m[cut - 1]["role"] == "assistant":
                cut -= 1
            if cut == len(m) or cut == 0:
                raise BadRow(f"{msgs} must end with an assistant turn after a user turn")
            return {"prompt": m[:cut], "completion": m[cut:]}

        return f"messages ({msgs})", dialogue
    if reply:
        prompt_fmt, to_prompt = prompt_converter(
            [c for c in columns if c not in (reply, "chosen", "rejected")], cols
        )

        def pair(row: dict) -> Record:
            completion = _as_messages(row.get(reply), reply, "assistant")
            if completion[0]["role"] != "assistant":
                raise BadRow(f"{reply} must be an assistant reply")
            return {"prompt": to_prompt(row), "completion": completion}

        return f"{prompt_fmt}/{reply}", pair
    raise UserError(
        f"cannot find prompt/completion pairs among columns {sorted(columns)}; "
        "set data.prompt_column and data.chosen_column (the reply), or data.messages_column"
    )

"""The vocabulary fingerprint: one definition shared by the GGUF export, the worker and the client.

A worker scores token ids, so the actor's tokenizer and the worker's vocabulary must agree id for
id. Both sides hash the token strings in id order; equal hashes mean the same ids name the same
tokens.
"""

from __future__ import annotations

import hashlib
import json
from typing import Sequence


def vocab_fingerprint(tokens: Sequence[str]) -> str:
    """sha256 (hex) of the token strings in id order. JSON keeps the encoding unambiguous."""
    blob = json.dumps(list(tokens), ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()


def tokenizer_tokens(tokenizer) -> list[str]:
    """Token strings of a HF tokenizer in id order (``len(tokenizer)`` of them; holes become "")."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return [t if t is not None else "" for t in tokens]


def tokenizer_fingerprint(tokenizer) -> str:
    """The fingerprint of a HF tokenizer, equal to the worker's for a GGUF exported with it."""
    return vocab_fingerprint(tokenizer_tokens(tokenizer))


def check_same_vocabulary(gguf_tokens: Sequence[str], tokenizer, rows: int, where: str) -> None:
    """A GGUF served as it is must score the policy's ids: the same number of rows as the policy's
    embedding (log-softmax runs over them all) and the same token at every id the tokenizer has."""
    from homerlhf.errors import UserError

    if len(gguf_tokens) != rows:
        raise UserError(f"{where} has {len(gguf_tokens)} tokens but the policy's embedding {rows}; "
                        "the reference must use the policy's tokenizer (same tokens, same ids)")
    ours = tokenizer_tokens(tokenizer)[:rows]
    for i, (theirs, mine) in enumerate(zip(gguf_tokens, ours)):
        if theirs != mine:
            raise UserError(f"{where} has a different vocabulary from the policy tokenizer (id {i}: {theirs!r} there, "
                            f"{mine!r} here); the reference must use the policy's tokenizer (same tokens, same ids)")

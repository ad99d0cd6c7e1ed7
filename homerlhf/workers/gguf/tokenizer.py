"""The vocabulary of an export: the HF fast tokenizer's tokens, types and merges/scores in GGUF.

Workers never tokenize text (ids come over the wire), so what matters is that id ``i`` names the
same token on both sides; the pre-tokenizer name is informational. An exported policy is used by
llama.cpp, Ollama and LM Studio on *text*: :func:`add_text_use` writes what they need to turn a
chat into the ids HF makes of it (the pre-tokenizer, BOS and space-prefix settings, the chat template).
"""

from __future__ import annotations

import json
import re

from homerlhf.errors import UserError
from homerlhf.workers.vocab import tokenizer_tokens, vocab_fingerprint

# Custom GGUF keys the worker reads back.
KEY_TOKENIZER_SIZE = "homerlhf.tokenizer_size"
KEY_VOCAB_FINGERPRINT = "homerlhf.vocab_fingerprint"

_BYTE_TOKEN = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")

# llama.cpp's pre-tokenizer for the split regex of a byte-level BPE tokenizer (llama-vocab.cpp), by
# the regex HF's tokenizer.json holds. Text split otherwise would give other ids than HF's.
_GPT2_REGEX = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"
_SPLIT_REGEXES = {
    # Llama 3.x
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
    "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+": "llama-bpe",
    # Qwen2, Qwen2.5, Qwen3
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
    "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+": "qwen2",
    _GPT2_REGEX: "gpt-2",
}


def _token_types(tokenizer, tokens: list[str], spm: bool) -> list[int]:
    import gguf

    added = dict(tokenizer.added_tokens_decoder.items())
    unk_id = tokenizer.unk_token_id
    types = []
    for i, tok in enumerate(tokens):
        if spm and i == unk_id:
            types.append(gguf.TokenType.UNKNOWN)
        elif spm and _BYTE_TOKEN.match(tok):  # byte-fallback pieces, even when listed as added tokens
            types.append(gguf.TokenType.BYTE)
        elif i in added:
            types.append(gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
    return [int(t) for t in types]


def _add_model(writer, model: dict, spm: bool, pre: str, vocab_size: int) -> None:
    if spm:
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        if model["type"] == "Unigram":
            scores = [float(s) for _, s in model["vocab"]] + [0.0] * vocab_size
        else:
            scores = [-float(i) for i in range(vocab_size)]
        writer.add_token_scores(scores[:vocab_size])
    else:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
        writer.add_token_merges(merges)


def add_tokenizer(writer, tokenizer, vocab_size: int, pre: str = "default", add_bos: bool = False) -> int:
    """Writes the vocabulary for an embedding of ``vocab_size`` rows; returns the real tokens written.

    Rows past the tokenizer (an embedding padded to a multiple of 64) become unused ``[PADi]``
    tokens. Tokens past the embedding (Gemma 3's tokenizer has one more id than its 262,144 rows)
    cannot reach the model and are left out; the fingerprint of the whole tokenizer is stored so
    the worker still proves it was exported with this very tokenizer.
    """
    import gguf

    if not getattr(tokenizer, "is_fast", False):
        raise UserError("GGUF export needs a fast tokenizer (tokenizer.json); install `tokenizers` and re-save it")
    model = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    if model["type"] not in ("BPE", "Unigram"):
        raise UserError(f"tokenizer model {model['type']!r} is not supported; supported: BPE (byte-level or byte-fallback), Unigram")
    spm = model["type"] == "Unigram" or (model["type"] == "BPE" and bool(model.get("byte_fallback")))
    all_tokens = tokenizer_tokens(tokenizer)
    beyond = [i for i in range(vocab_size, len(all_tokens)) if i not in tokenizer.added_tokens_decoder]
    if beyond:
        raise UserError(f"the tokenizer has {len(all_tokens)} tokens but the model's embedding only {vocab_size}; "
                        "the model dir must hold the model's own tokenizer")
    tokens = all_tokens[:vocab_size]
    n_real = len(tokens)
    types = _token_types(tokenizer, tokens, spm)
    tokens += [f"[PAD{i}]" for i in range(n_real, vocab_size)]
    types += [int(gguf.TokenType.UNUSED)] * (vocab_size - n_real)
    _add_model(writer, model, spm, pre, vocab_size)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    for key, token_id in (("bos", tokenizer.bos_token_id), ("eos", tokenizer.eos_token_id),
                          ("unk", tokenizer.unk_token_id), ("pad", tokenizer.pad_token_id)):
        if token_id is not None and token_id < vocab_size:
            getattr(writer, f"add_{key}_token_id")(int(token_id))
    writer.add_add_bos_token(add_bos)
    writer.add_add_eos_token(False)
    writer.add_uint32(KEY_TOKENIZER_SIZE, n_real)
    writer.add_string(KEY_VOCAB_FINGERPRINT, vocab_fingerprint(all_tokens))
    return n_real


def _tokenizer_json(tokenizer) -> dict:
    return json.loads(tokenizer.backend_tokenizer.to_str())


def text_pre_tokenizer(tokenizer) -> str:
    """llama.cpp's name for the way ``tokenizer`` splits text before BPE, or a UserError when
    llama.cpp has none that splits as it does (its text would become other ids than HF's)."""
    spec = _tokenizer_json(tokenizer)
    if spec["model"]["type"] == "Unigram" or spec["model"].get("byte_fallback"):
        return "default"  # SentencePiece-style: llama.cpp's SPM tokenizer has no pre-tokenizer
    pre = spec.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [p.get("type") for p in parts]
    if kinds == ["ByteLevel"] and parts[0].get("use_regex", True):
        return "gpt-2"
    if kinds == ["Split", "ByteLevel"] and not parts[1].get("use_regex", True):
        name = _SPLIT_REGEXES.get((parts[0].get("pattern") or {}).get("Regex", ""))
        if name:
            return name
    raise UserError("the tokenizer splits text in a way llama.cpp's pre-tokenizers do not reproduce "
                    f"({json.dumps(pre)[:120]}); llama.cpp would tokenize prompts differently from HF. "
                    "Export the merged HF model only (drop --gguf)")


def adds_bos(tokenizer) -> bool:
    """Whether HF's tokenizer starts plain text with BOS (llama.cpp's ``add_bos_token``)."""
    bos = tokenizer.bos_token_id
    return bos is not None and tokenizer("a")["input_ids"][:1] == [bos]


def add_text_use(writer, tokenizer) -> None:
    """What llama.cpp reads, besides the pre-tokenizer and BOS (:func:`add_tokenizer`'s ``pre`` and
    ``add_bos``), to tokenize text and chats as HF does: SentencePiece's space prefix, the chat template."""
    spec = _tokenizer_json(tokenizer)
    if spec["model"]["type"] == "Unigram" or spec["model"].get("byte_fallback"):
        writer.add_add_space_prefix('"Prepend"' in json.dumps(spec.get("normalizer") or {}))
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: llama.cpp reads the default one
        template = template.get("default")
    if template:
        writer.add_chat_template(template)

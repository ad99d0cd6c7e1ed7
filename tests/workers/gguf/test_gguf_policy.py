"""An exported policy's GGUF for text: real tokenizers' chat templates and chats through llama.cpp's
own tokenizer, the Ollama Modelfile's stop tokens, llama.cpp's k-quant fallback on narrow rows.
(The merged model and each type's log-probs against the trained policy: tests/stages/test_export.py.)
"""

from __future__ import annotations

import json

import pytest

from homerlhf.errors import UserError

CHATS = [
    [{"role": "user", "content": "Hello there! How are you?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2= ?\n  Say  it."},
     {"role": "assistant", "content": "It is 4 — naïve café, 1234567."}, {"role": "user", "content": "Thanks 😀"}],
]

# llama.cpp's own tokenizer on the GGUF's vocabulary (no weights loaded), in a child interpreter.
TOKENIZE = """
import json, sys
from llama_cpp import Llama
llm = Llama(sys.argv[1], vocab_only=True, verbose=False)
cases = json.loads(sys.argv[2])  # [text, add_bos]
print(json.dumps({"template": llm.metadata.get("tokenizer.chat_template"),
                  "ids": [llm.tokenize(t.encode(), add_bos=bos, special=True) for t, bos in cases]}))
"""
PLAIN = ["Once upon a time,  there were 12345 cats.\nThe end?", " leading space and naïve café"]


@pytest.mark.slow  # the real vocabularies' tiny models (shared session fixtures) and up to 262k tokens
@pytest.mark.parametrize("name", ["qwen3", "llama3_1", "gemma3"])
def test_real_chat_template_and_chats_survive_the_round_trip(name, real_vocab_model_dir, tmp_path):
    from transformers import AutoTokenizer, GenerationConfig

    from homerlhf.doctor import run_child
    from homerlhf.models.generation import stop_token_ids
    from homerlhf.data.replies import template_end_of_turn_ids
    from homerlhf.workers.gguf.policy import export_policy_gguf, stop_tokens

    model_dir = real_vocab_model_dir(name)
    tok = AutoTokenizer.from_pretrained(model_dir)
    stops = stop_tokens(tok, stop_token_ids(tok, GenerationConfig.from_pretrained(model_dir)))
    [gguf] = export_policy_gguf(model_dir, tmp_path, ["f16"], name, stops)
    chats = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in CHATS]
    cases = [[t, False] for t in chats] + [[t, True] for t in PLAIN]  # the template writes its own BOS
    got = run_child(TOKENIZE, str(gguf.path), json.dumps(cases), timeout=300)
    assert got["template"] == tok.chat_template
    # llama.cpp turns the rendered chats into the ids HF's chat template gives, and plain text into
    # HF's ids, BOS included where HF adds one (its pre-tokenizer, BOS and space-prefix settings).
    want = [list(tok.apply_chat_template(c, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"])
            for c in CHATS] + [tok(t)["input_ids"] for t in PLAIN]
    assert got["ids"] == want
    [end_of_turn] = template_end_of_turn_ids(tok)
    modelfile = gguf.modelfile.read_text()
    assert f"PARAMETER stop {json.dumps(tok.decode([end_of_turn]))}" in modelfile
    assert modelfile.startswith(f"FROM ./{name}-f16.gguf\n")


def test_k_quants_fall_back_where_rows_do_not_split_into_256_blocks(tiny_llama_dir, tmp_path):
    from collections import Counter

    import gguf as gguf_py

    from homerlhf.workers.gguf.policy import export_policy_gguf

    [gguf] = export_policy_gguf(tiny_llama_dir, tmp_path, ["q4_k_m"], "tiny", ["<|end|>"])
    types = Counter(t.tensor_type.name for t in gguf_py.GGUFReader(str(gguf.path)).tensors)
    assert "Q4_K" not in types and types["Q5_0"] > 0  # hidden 128: llama.cpp's fallback for q4_K
    assert f"{types['Q5_0']} Q5_0" in gguf.summary  # the summary counts what the file holds
    assert "went to" in gguf.summary and "q5_0" in gguf.summary
    assert sorted(p.name for p in tmp_path.iterdir()) == ["Modelfile.q4_k_m", "tiny-q4_k_m.gguf"]  # source removed


def test_gguf_types_and_tokenizers_llama_cpp_would_misread_are_refused_up_front(tiny_llama_dir):
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    from homerlhf.workers.gguf.policy import check_policy_gguf, parse_types

    assert parse_types(["f16,q4_k_m", "f16", " Q8_0 "]) == ["f16", "q4_k_m", "q8_0"]
    with pytest.raises(UserError, match="--gguf 'q3' is not a type homerlhf exports"):
        parse_types(["q3"])
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    check_policy_gguf(tiny_llama_dir, tok)  # GPT-2's split: llama.cpp's gpt-2 pre-tokenizer
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    with pytest.raises(UserError, match="llama.cpp would tokenize prompts differently from HF"):
        check_policy_gguf(tiny_llama_dir, tok)

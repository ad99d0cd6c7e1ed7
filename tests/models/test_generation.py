"""The stop set of real tokenizers and the complete rollout generation config."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer, GenerationConfig

from homerlhf.models.generation import (
    build_generation_config,
    stop_token_ids,
    template_end_of_turn_ids,
)
from homerlhf.tiny import build_tokenizer

# What each chat template writes after an assistant reply, and the checkpoint's eos list
# (tests/fixtures/tokenizers/*/generation_config.json), by token text.
EXPECTED = {
    "qwen3": ("<|im_end|>", ["<|im_end|>", "<|endoftext|>"]),
    "llama3_1": ("<|eot_id|>", ["<|end_of_text|>", "<|reserved_special_token_4|>", "<|eot_id|>"]),
    "gemma3": ("<end_of_turn>", ["<eos>", "<end_of_turn>"]),
}


@pytest.fixture(scope="module")
def tokenizers(real_tokenizer_dirs):
    return {name: AutoTokenizer.from_pretrained(str(path)) for name, path in real_tokenizer_dirs.items()}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_stop_set_is_what_the_template_and_checkpoint_imply(name, tokenizers, real_tokenizer_dirs):
    tok = tokenizers[name]
    end_of_turn, checkpoint_eos = EXPECTED[name]
    assert template_end_of_turn_ids(tok) == [tok.convert_tokens_to_ids(end_of_turn)]
    generation = GenerationConfig.from_pretrained(str(real_tokenizer_dirs[name]))
    expected = sorted(set(tok.convert_tokens_to_ids([end_of_turn, *checkpoint_eos])))
    assert stop_token_ids(tok, generation) == expected
    # The ids, written out: Qwen3 {<|endoftext|>, <|im_end|>}, Llama-3 {128001, 128008, 128009}, Gemma-3 {1, 106}.
    assert expected == {"qwen3": [151643, 151645], "llama3_1": [128001, 128008, 128009], "gemma3": [1, 106]}[name]
    # The newline Qwen and Gemma write after the end-of-turn token is text, not a stop.
    assert tok.convert_tokens_to_ids(tok.tokenize("\n"))[0] not in expected


@pytest.mark.parametrize("name, base_eos", [("qwen3", "<|endoftext|>"), ("gemma3", "<eos>")])
def test_template_end_of_turn_is_a_stop_even_when_eos_is_another_token(name, base_eos, real_tokenizer_dirs):
    """Base checkpoints ship eos = end-of-text while the chat template ends turns with its own token:
    both stop, with no generation config to help."""
    tok = AutoTokenizer.from_pretrained(str(real_tokenizer_dirs[name]))
    tok.eos_token = base_eos
    end_of_turn = EXPECTED[name][0]
    assert stop_token_ids(tok) == sorted(tok.convert_tokens_to_ids([base_eos, end_of_turn]))


def test_builtin_tokenizer_and_a_tokenizer_without_template():
    tok = build_tokenizer()
    assert stop_token_ids(tok, GenerationConfig(eos_token_id=tok.eos_token_id)) == [tok.eos_token_id]
    assert template_end_of_turn_ids(tok) == [tok.convert_tokens_to_ids("<|end|>")]
    tok.chat_template = None
    assert template_end_of_turn_ids(tok) == []
    assert stop_token_ids(tok, GenerationConfig(eos_token_id=[7, 9])) == sorted({tok.eos_token_id, 7, 9})


def test_a_template_that_ends_turns_with_text_gives_no_stop():
    tok = build_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n\\n' }}{% endfor %}"
    assert template_end_of_turn_ids(tok) == []


def test_generation_config_is_complete_and_neutral():
    config = build_generation_config(max_new_tokens=7, temperature=0.7, stop_ids=[106, 1, 106], pad_id=0)
    assert (config.do_sample, config.num_beams, config.max_new_tokens, config.temperature) == (True, 1, 7, 0.7)
    assert config.eos_token_id == [1, 106] and config.pad_token_id == 0
    # Off, explicitly: HF's own global default for top_k is 50.
    assert (config.top_k, config.top_p, config.typical_p, config.min_length) == (0, 1.0, 1.0, 0)
    assert (config.repetition_penalty, config.no_repeat_ngram_size, config.length_penalty) == (1.0, 0, 1.0)
    for field in ("suppress_tokens", "begin_suppress_tokens", "forced_bos_token_id", "forced_eos_token_id",
                  "bad_words_ids", "sequence_bias", "min_p", "min_new_tokens", "stop_strings"):
        assert getattr(config, field) is None, field


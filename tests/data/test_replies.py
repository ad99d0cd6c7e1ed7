"""The sequence a reward model scores: the rendered generation prompt, the reply, its end-of-turn
token, nothing after it, with the real Qwen3, Llama-3.1 and Gemma-3 chat templates."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from homerlhf.data.replies import reply_text, reward_sequence_ids, turn_end_id
from homerlhf.data.tokens import prompt_ids, render
from homerlhf.errors import UserError
from homerlhf.tiny import build_tokenizer

PROMPT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about tea, please."}]
REPLY = [{"role": "assistant", "content": "Tea is made by steeping leaves."}]
# The end-of-turn token and what the template writes after it (which the shape must not hold).
END = {"qwen3": ("<|im_end|>", "\n"), "llama3_1": ("<|eot_id|>", ""), "gemma3": ("<end_of_turn>", "\n")}


@pytest.fixture(scope="module")
def tokenizers(real_tokenizer_dirs):
    from homerlhf.models.policy import load_tokenizer

    # As the stages load them: Llama-3.1 ships no pad token and gets pad = eos.
    return {name: load_tokenizer(str(path), trust_remote_code=False, padding_side=None)
            for name, path in real_tokenizer_dirs.items()}


@pytest.mark.parametrize("name", sorted(END))
def test_shape_is_generation_prompt_reply_and_end_of_turn(name, tokenizers):
    tok = tokenizers[name]
    end, after_end = END[name]
    ids = reward_sequence_ids(tok, PROMPT, REPLY)
    head = prompt_ids(tok, PROMPT)
    assert ids[:len(head)] == head  # starts with the rendered generation prompt, token for token
    assert ids[-1] == tok.convert_tokens_to_ids(end) == turn_end_id(tok)
    generation_prompt = render(tok, PROMPT, add_generation_prompt=True)
    assert tok.decode(ids) == generation_prompt + "Tea is made by steeping leaves." + end
    # The rendered whole dialogue is something else: text after the end of turn, and for Qwen3 an
    # empty think block the generation prompt does not write.
    dialogue = render(tok, PROMPT + REPLY)
    assert dialogue.endswith(end + after_end)
    assert ("<think>\n\n</think>\n\n" in dialogue) == (name == "qwen3")
    assert "<think>" not in tok.decode(ids)


@pytest.mark.parametrize("name", sorted(END))
def test_reply_tokens_are_those_of_the_reply_in_context(name, tokenizers):
    """Encoding the reply alone gives the ids it has after the generation prompt (no merge across
    the boundary), so the prompt part is exactly PPO's prompt ids."""
    tok = tokenizers[name]
    generation_prompt = render(tok, PROMPT, add_generation_prompt=True)
    for content in ["Tea is made by steeping leaves.", "Sure! 1, 2, 3.", "Héllo — ça va?"]:
        ids = reward_sequence_ids(tok, PROMPT, [{"role": "assistant", "content": content}])
        joint = tok(generation_prompt + content, add_special_tokens=False)["input_ids"]
        assert ids[:-1] == joint


def test_reply_as_the_template_writes_it(tokenizers):
    """Llama-3 and Gemma trim the content, Qwen3 keeps it; the shape follows the template."""
    content = "  Hi there.  "
    assert reply_text(tokenizers["llama3_1"], PROMPT, content) == "Hi there."
    assert reply_text(tokenizers["gemma3"], PROMPT, content) == "Hi there."
    assert reply_text(tokenizers["qwen3"], PROMPT, content) == content


def test_earlier_turns_of_the_reply_are_context(tokenizers):
    tok = tokenizers["llama3_1"]
    reply = [{"role": "assistant", "content": "Green or black?"}, {"role": "user", "content": "Green."},
             {"role": "assistant", "content": "Green tea is steamed or pan-fired."}]
    ids = reward_sequence_ids(tok, PROMPT, reply)
    head = prompt_ids(tok, PROMPT + reply[:2])
    assert ids[:len(head)] == head
    assert tok.decode(ids[len(head):]) == "Green tea is steamed or pan-fired.<|eot_id|>"
    with pytest.raises(UserError, match="must end with an assistant turn"):
        reward_sequence_ids(tok, PROMPT, reply[:2])


def test_builtin_tokenizer_and_a_base_tokenizer_without_template():
    tok = build_tokenizer()
    ids = reward_sequence_ids(tok, PROMPT[1:], REPLY)
    assert tok.decode(ids) == "<|user|>Tell me about tea, please.<|end|><|assistant|>Tea is made by steeping leaves.<|end|>"
    assert ids[-1] == tok.eos_token_id
    tok.chat_template = None
    ids = reward_sequence_ids(tok, PROMPT[1:], REPLY)
    # Plain text: a single user turn is its bare content and a newline (data.tokens.render).
    assert tok.decode(ids) == "Tell me about tea, please.\nTea is made by steeping leaves.<|end|>"
    assert ids[:len(prompt_ids(tok, PROMPT[1:]))] == prompt_ids(tok, PROMPT[1:])


def test_turn_end_is_the_templates_token_else_eos_else_an_error(real_tokenizer_dirs):
    tok = AutoTokenizer.from_pretrained(str(real_tokenizer_dirs["gemma3"]))
    tok.eos_token = "<eos>"  # a base checkpoint's EOS: the template still ends turns with its own token
    assert turn_end_id(tok) == tok.convert_tokens_to_ids("<end_of_turn>") != tok.eos_token_id
    plain = build_tokenizer()
    plain.chat_template = None
    assert turn_end_id(plain) == plain.eos_token_id
    plain.eos_token = None
    with pytest.raises(UserError, match="neither an end-of-turn token"):
        turn_end_id(plain)


@pytest.mark.parametrize("name", sorted(END))
def test_encoder_gives_the_functions_ids_rendering_each_context_once(name, tokenizers, monkeypatch):
    """The stages encode a dataset with one ReplyEncoder: per record the same ids as
    reward_sequence_ids, for replies that share a prompt and ones with earlier turns, while each
    distinct context is probed and rendered with its generation prompt once."""
    import homerlhf.data.replies as replies

    tok = tokenizers[name]
    other = [{"role": "user", "content": "And coffee?"}]
    cases = [(PROMPT, REPLY), (PROMPT, [{"role": "assistant", "content": "  Tea: leaves, steeped. "}]),
             (other, REPLY), (PROMPT, [*REPLY, {"role": "user", "content": "More?"}, *REPLY]), (other, REPLY)]
    def by_parts(prompt, reply):  # the shape, from the module's parts, with no encoder in between
        context = [*prompt, *reply[:-1]]
        text = reply_text(tok, context, reply[-1]["content"])
        return [*prompt_ids(tok, context), *tok(text, add_special_tokens=False)["input_ids"], turn_end_id(tok)]

    expected = [by_parts(p, r) for p, r in cases]
    assert [reward_sequence_ids(tok, p, r) for p, r in cases] == expected
    import homerlhf.data.tokens as tokens

    calls = []
    real_render = tokens.render

    def counted(t, m, add_generation_prompt=False):
        calls.append("prompt" if add_generation_prompt else "turn")
        return real_render(t, m, add_generation_prompt=add_generation_prompt)

    monkeypatch.setattr(tokens, "render", counted)
    monkeypatch.setattr(replies, "render", counted)
    encoder = replies.ReplyEncoder(tok)
    assert [encoder.sequence_ids(p, r) for p, r in cases] == expected
    assert encoder.prompt_ids(PROMPT) == prompt_ids(tok, PROMPT)
    # the 3 distinct contexts: each probed once and rendered with its generation prompt once; the
    # end-of-turn probe once; one render per reply; the last prompt_ids call above renders anew
    assert calls.count("prompt") == 3 + 1
    assert calls.count("turn") == 3 + 1 + len(cases)

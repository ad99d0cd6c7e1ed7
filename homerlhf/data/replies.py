"""How an assistant reply becomes tokens: the token that ends its turn, and the one sequence a
reward model scores.

PPO scores ``prompt ids + sampled response``, where the prompt is rendered with the generation
prompt and the response ends at its first stop token, with nothing after it. The reward model must
be trained and evaluated on exactly that shape (:func:`reward_sequence_ids`), not on the rendered
whole dialogue: chat templates write text after the end-of-turn token (Qwen's and Gemma's
``"\\n"``) and text into an assistant turn that the generation prompt does not (Qwen3's empty
``<think>\\n\\n</think>\\n\\n``), so a score head trained there reads at a token PPO never makes.
"""

from __future__ import annotations

import json

from homerlhf.data.formats import Message
from homerlhf.data.tokens import prompt_ids, render
from homerlhf.errors import UserError

# Assistant text for the probe conversation; plain ASCII no template rewrites.
PROBE_REPLY = "PROBE"


def _probe(tokenizer, context: list[Message]) -> tuple[str, str]:
    """(text before, text after) the assistant content in ``render(context + [assistant PROBE])``."""
    rendered = render(tokenizer, [*context, {"role": "assistant", "content": PROBE_REPLY}])
    at = rendered.rfind(PROBE_REPLY)
    if at < 0:
        return rendered, ""
    return rendered[:at], rendered[at + len(PROBE_REPLY):]


def template_end_of_turn_ids(tokenizer) -> list[int]:
    """The special token the chat template writes right after an assistant reply, as a list.

    Found by rendering ``[user, assistant PROBE_REPLY]`` and tokenizing what follows the reply:
    Qwen's ``<|im_end|>``, Llama-3's ``<|eot_id|>``, Gemma's ``<end_of_turn>``. Only a special
    (added) token counts: the newline some templates write after it is text, not a stop. Empty when
    the tokenizer has no chat template, the reply is followed by nothing, or by ordinary text.
    """
    if not getattr(tokenizer, "chat_template", None):
        return []
    _, after = _probe(tokenizer, [{"role": "user", "content": "Hi"}])
    if not after:
        return []
    ids = tokenizer(after, add_special_tokens=False)["input_ids"]
    if not ids:
        return []
    added = tokenizer.added_tokens_decoder.get(ids[0])
    return [ids[0]] if added is not None and added.special else []


def turn_end_id(tokenizer) -> int:
    """The token a finished reply ends with: the template's end-of-turn token, else the EOS.

    It is one of the policy's stop set (``homerlhf.models.generation.stop_token_ids``), the one a
    model trained on the template writes.
    """
    ids = template_end_of_turn_ids(tokenizer)
    if ids:
        return ids[0]
    if tokenizer.eos_token_id is None:
        raise UserError("the tokenizer has neither an end-of-turn token in its chat template nor an EOS token; "
                        "use a tokenizer with a chat template or set its eos_token")
    return int(tokenizer.eos_token_id)


def _reply_inside(rendered: str, before: str, after: str, content: str) -> str:
    if rendered.startswith(before) and rendered.endswith(after) and len(rendered) >= len(before) + len(after):
        return rendered[len(before):len(rendered) - len(after)]
    return content  # a template that rewrites the content: take it as given


def reply_text(tokenizer, context: list[Message], content: str) -> str:
    """``content`` as the model writes it after the generation prompt of ``context``.

    That is the text the template renders for the assistant turn, without what the template puts
    around it: templates may trim the content (Llama-3, Gemma) or open the turn with text the
    generation prompt lacks (Qwen3's empty think block), which is dropped here. Without a chat
    template it is the content as given.
    """
    before, after = _probe(tokenizer, context)
    return _reply_inside(render(tokenizer, [*context, {"role": "assistant", "content": content}]), before, after, content)


class ReplyEncoder:
    """:func:`reward_sequence_ids` for the many records of one tokenizer: the turn's end token found
    once, and each distinct context's probe and prompt ids once (datasets repeat their prompts, and
    a preference pair's two replies share one). The same ids as the function, in about a quarter of
    the template renders; the tokenizer must not change while the encoder is in use."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._end_id: int | None = None
        self._contexts: dict[str, tuple[str, str, list[int]]] = {}

    def end_id(self) -> int:
        if self._end_id is None:
            self._end_id = turn_end_id(self.tokenizer)
        return self._end_id

    def _context(self, context: list[Message]) -> tuple[str, str, list[int]]:
        key = json.dumps(context, sort_keys=True, default=str)
        if key not in self._contexts:
            self._contexts[key] = (*_probe(self.tokenizer, context), prompt_ids(self.tokenizer, context))
        return self._contexts[key]

    def prompt_ids(self, prompt: list[Message]) -> list[int]:
        """:func:`homerlhf.data.tokens.prompt_ids` of ``prompt`` (a copy)."""
        return list(self._context(prompt)[2])

    def sequence_ids(self, prompt: list[Message], reply: list[Message]) -> list[int]:
        """:func:`reward_sequence_ids` of ``reply`` to ``prompt``."""
        if not reply or reply[-1]["role"] != "assistant":
            raise UserError("a reply to score must end with an assistant turn")
        context = [*prompt, *reply[:-1]]
        before, after, head = self._context(context)
        content = reply[-1]["content"]
        rendered = render(self.tokenizer, [*context, {"role": "assistant", "content": content}])
        text = _reply_inside(rendered, before, after, content)
        return [*head, *self.tokenizer(text, add_special_tokens=False)["input_ids"], self.end_id()]


def reward_sequence_ids(tokenizer, prompt: list[Message], reply: list[Message]) -> list[int]:
    """The ids a reward model scores for ``reply`` to ``prompt``, exactly as PPO makes them.

    ``prompt_ids(prompt)`` (rendered with the generation prompt) + the reply's tokens + the turn's
    end token (:func:`turn_end_id`), and nothing after it. ``reply``: the assistant turn(s) after
    ``prompt``; turns before the last one become part of the context, the last one is the reply.
    Many records of one tokenizer: :class:`ReplyEncoder`, the same ids in fewer renders.
    """
    return ReplyEncoder(tokenizer).sequence_ids(prompt, reply)

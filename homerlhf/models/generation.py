"""What a rollout samples from, stated in full: its ``GenerationConfig`` and its stop set.

PPO scores every sampled token with ``log_softmax(logits / temperature)`` (old, new and reference
log-probs alike). The samples must come from exactly that distribution, yet HF ``generate`` fills
every field a caller leaves unset from the checkpoint's ``generation_config.json``: a
``repetition_penalty``, ``no_repeat_ngram_size``, default ``top_k``/``top_p``/``temperature``,
suppressed or forced tokens, a minimum length. Any of them makes the rollout off-policy from the
first step, silently. So a rollout's config is built from our settings alone, with every logits
processor explicitly off, and the model's own generation config is set aside while it samples
(:func:`checkpoint_defaults_off`).

A turn ends at any token of the stop set (:func:`stop_token_ids`): the tokenizer's EOS, the
checkpoint's ``eos_token_id`` list, and the token the chat template closes an assistant turn with.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, Iterator, Optional

from homerlhf.data.replies import PROBE_REPLY, template_end_of_turn_ids  # noqa: F401 - part of the stop set's API


def build_generation_config(*, max_new_tokens: int, temperature: float, stop_ids: Iterable[int], pad_id: int,
                            prefill_chunk_size: Optional[int] = None):
    """A complete ``GenerationConfig`` for sampling from ``softmax(logits / temperature)``.

    Every field a checkpoint could set to reshape the distribution is given its "off" value here;
    the fields whose only "off" value is ``None`` (suppressed/forced tokens, bad words, sequence
    bias, min-p, min_new_tokens, stop strings) are kept off by :func:`checkpoint_defaults_off`.
    ``prefill_chunk_size``: prompt columns per prefill forward
    (:meth:`homerlhf.config.schema.RolloutConfig.prefill_columns`; None: one forward).
    HF ``generate`` prefills its cache in such pieces itself (transformers' chunked prefill: the
    attention mask and position ids sliced as one forward has them, the logits of the last piece's
    last position sampled), and so does :mod:`homerlhf.models.static_decode`: the sampling steps,
    and what the logits processors see, are the same.
    """
    from transformers import GenerationConfig

    return GenerationConfig(
        do_sample=True,
        num_beams=1,
        num_return_sequences=1,
        max_new_tokens=max_new_tokens,
        min_length=0,  # (min_new_tokens stays None: HF warns when both are set)
        temperature=temperature,
        top_k=0,  # HF's global default is 50, not off
        top_p=1.0,
        typical_p=1.0,
        epsilon_cutoff=0.0,
        eta_cutoff=0.0,
        repetition_penalty=1.0,
        encoder_repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        encoder_no_repeat_ngram_size=0,
        length_penalty=1.0,
        renormalize_logits=False,
        remove_invalid_values=False,
        eos_token_id=sorted(set(int(i) for i in stop_ids)),
        pad_token_id=pad_id,
        use_cache=True,
        prefill_chunk_size=prefill_chunk_size,
    )


@contextmanager
def checkpoint_defaults_off(model, generation_config) -> Iterator[None]:
    """Make ``generation_config`` the model's own for the duration of a ``generate`` call.

    ``generate`` fills every ``None`` field of the config it is given from
    ``model.generation_config``; with that replaced by the given config itself, nothing from the
    checkpoint's ``generation_config.json`` can reach the sampler. ``model``: the HF model (for a
    peft model, ``get_base_model()``: peft reads the config from there).
    """
    saved = model.generation_config
    model.generation_config = generation_config
    try:
        yield
    finally:
        model.generation_config = saved


def stop_token_ids(tokenizer, generation_config: Optional[object] = None) -> list[int]:
    """The stop set of a tokenizer/checkpoint pair, sorted: the tokenizer's EOS, the generation
    config's ``eos_token_id`` (an int or a list) and :func:`template_end_of_turn_ids`."""
    ids: set[int] = set(template_end_of_turn_ids(tokenizer))
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    listed = getattr(generation_config, "eos_token_id", None)
    if listed is not None:
        ids.update(int(i) for i in ([listed] if isinstance(listed, int) else listed))
    return sorted(ids)


class BehaviourLogprobs:
    """A logits processor that records ``log_softmax(logits / temperature)`` of each sampled token.

    Passed to ``generate(logits_processor=[...])``, it runs before HF's temperature warper (custom
    processors come first), so it sees the raw logits, as ``output_logits`` would return them. Each
    call keeps one step's (B, V) log-probs until the next call shows which token was sampled, so
    memory stays at one step, not ``output_scores``' (B, T, V). :meth:`taken` gathers the last step.
    """

    def __init__(self, temperature: float):
        self.temperature = float(temperature)
        self._pending = None  # (B, V) float32 log-probs of the step whose token is not yet known
        self._taken: list = []  # per step: (B,) log-prob of the sampled token

    def __call__(self, input_ids, scores):
        import torch

        if self._pending is not None:
            self._taken.append(self._pending.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self._pending = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def keep_steps(self, steps: int) -> None:
        """Forget every step after the first ``steps``: a loop that checks for the end only every few
        steps (:mod:`homerlhf.models.static_decode`) may have run on after its last row stopped."""
        if steps < len(self._taken) + (self._pending is not None):
            # Step s's log-prob is in ``_taken`` once step s + 1 ran (its input showed the token).
            self._taken, self._pending = self._taken[:steps], None

    def taken(self, response_ids):
        """(B, T) log-probs of ``response_ids`` (B, T), the generated block; T must be the steps taken."""
        import torch

        steps = self._taken + ([self._pending.gather(-1, response_ids[:, -1:]).squeeze(-1)]
                               if self._pending is not None else [])
        if len(steps) != response_ids.shape[1]:
            raise ValueError(f"recorded {len(steps)} steps for {response_ids.shape[1]} generated tokens")
        return torch.stack(steps, dim=1) if steps else response_ids.new_zeros(response_ids.shape, dtype=torch.float32)

"""Rollout: batched sampling with the actor from left-padded prompts.

A rollout batch is a left-padded prompt block (B, P) and a right-padded response block (B, T) whose
mask is 1 up to and including each row's first stop token (any of the policy's stop set: EOS, the
checkpoint's eos list, the chat template's end-of-turn token). Prompts were fitted to
``max_prompt_len`` when tokenised; a longer one is refused here, never cut. Rows that hit ``max_new_tokens``
without one are ``truncated``; their score can be replaced by ``cfg.rollout.truncation_penalty``.
Sampling uses a complete generation config built from ``cfg.rollout`` alone
(:func:`homerlhf.models.generation.build_generation_config`), with HF ``generate`` or, as
``rollout.decoder`` says, the static-cache loop of :mod:`homerlhf.models.static_decode` (the same
samples; a captured CUDA graph per decode step on CUDA). Either prefills a chunk whose prompt block
holds more than ``rollout.prefill_tokens`` in column pieces (the same samples, one piece's transients).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Literal, Optional, Sequence

import torch
from torch import Tensor

from homerlhf.config.schema import RolloutConfig
from homerlhf.errors import UserError
from homerlhf.models.generation import BehaviourLogprobs, build_generation_config
from homerlhf.models.sampling import PerSampleSampler
from homerlhf.models.static_decode import resolve_decoder
from homerlhf.ppo.devices import unpadded_lists
from homerlhf.ppo.math import truncation_penalized_scores


@dataclass
class RolloutBatch:
    prompt_ids: Tensor  # (B, P) long, left-padded with the pad id
    prompt_mask: Tensor  # (B, P) long, 1 on prompt tokens
    response_ids: Tensor  # (B, T) long, right-padded with the pad id after the stop token
    response_mask: Tensor  # (B, T) long, 1 up to and including the first stop token
    truncated: Tensor  # (B,) bool, hit max_new_tokens without a stop token
    # (B, T) float32 log-prob of each sampled token under the sampler's own distribution (the
    # behaviour policy), 0 after the stop token; None when the sampler does not report it.
    behaviour_logprobs: Optional[Tensor] = None

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    def prompt_lists(self) -> list[list[int]]:
        """Prompt ids without padding, one list per sample (what backends take)."""
        return unpadded_lists(self.prompt_ids, self.prompt_mask)

    def response_lists(self) -> list[list[int]]:
        """Response ids up to and including the stop token, one list per sample."""
        return unpadded_lists(self.response_ids, self.response_mask)

    def rows(self, start: int, end: int) -> "RolloutBatch":
        """Samples ``start:end`` (same padded widths)."""
        behaviour = self.behaviour_logprobs[start:end] if self.behaviour_logprobs is not None else None
        return RolloutBatch(self.prompt_ids[start:end], self.prompt_mask[start:end], self.response_ids[start:end],
                            self.response_mask[start:end], self.truncated[start:end], behaviour)

    @classmethod
    def cat(cls, parts: Sequence["RolloutBatch"], pad_id: int) -> "RolloutBatch":
        """Batches (chunks of different widths) along the batch: prompts padded on the left,
        responses on the right. Behaviour log-probs are kept only if every part has them."""
        width_p = max(p.prompt_ids.shape[1] for p in parts)
        width_t = max(p.response_ids.shape[1] for p in parts)
        left = lambda t, fill: torch.nn.functional.pad(t, (width_p - t.shape[1], 0), value=fill)  # noqa: E731
        right = lambda t, fill: torch.nn.functional.pad(t, (0, width_t - t.shape[1]), value=fill)  # noqa: E731
        behaviour = None
        if all(p.behaviour_logprobs is not None for p in parts):
            behaviour = torch.cat([right(p.behaviour_logprobs, 0.0) for p in parts])
        return cls(torch.cat([left(p.prompt_ids, pad_id) for p in parts]),
                   torch.cat([left(p.prompt_mask, 0) for p in parts]),
                   torch.cat([right(p.response_ids, pad_id) for p in parts]),
                   torch.cat([right(p.response_mask, 0) for p in parts]),
                   torch.cat([p.truncated for p in parts]), behaviour)

    def sequences(self) -> tuple[Tensor, Tensor]:
        """``(input_ids, attention_mask)``, each (B, P + T): prompt then response."""
        input_ids = torch.cat([self.prompt_ids, self.response_ids], dim=1)
        attention_mask = torch.cat([self.prompt_mask, self.response_mask], dim=1)
        return input_ids, attention_mask


def pad_sequences(sequences: Sequence[Sequence[int]], pad_id: int, side: Literal["left", "right"] = "left",
                  device=None) -> tuple[Tensor, Tensor]:
    """Token lists -> ``(ids, mask)``, each (B, max_len) long, padded on ``side`` with ``pad_id``.

    Prompts are padded on the left (generation continues from the last column), responses and
    whole sequences for a sequence classifier on the right.
    """
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long, device="cpu")  # filled here, copied once
    mask = torch.zeros((len(sequences), width), dtype=torch.long, device="cpu")
    for row, seq in enumerate(sequences):
        if len(seq):
            cols = slice(width - len(seq), width) if side == "left" else slice(0, len(seq))
            ids[row, cols] = torch.as_tensor(list(seq), dtype=torch.long, device="cpu")
            mask[row, cols] = 1
    return ids.to(device), mask.to(device)


def response_mask_and_truncated(response_ids: Tensor, stop_ids: Iterable[int]) -> tuple[Tensor, Tensor]:
    """From raw generated ids (B, T) and the stop set: mask (B, T) long, 1 up to and including the
    first stop token, and truncated (B,) bool, True where a row has none."""
    stops = torch.as_tensor(sorted(set(stop_ids)), dtype=response_ids.dtype, device=response_ids.device)
    is_stop = torch.isin(response_ids, stops)
    # Tokens strictly after the first stop have a positive count of stops before them.
    stops_before = torch.cumsum(is_stop.long(), dim=1) - is_stop.long()
    mask = (stops_before == 0).long()
    truncated = ~is_stop.any(dim=1)
    return mask, truncated


def check_prompt_lengths(prompts: Sequence[Sequence[int]], max_prompt_len: int) -> None:
    """Refuse prompts longer than ``max_prompt_len``: ids are never cut here (that would drop BOS
    and the system turn); :func:`homerlhf.data.tokens.tokenize_prompts` fits them while rendering."""
    for i, prompt in enumerate(prompts):
        if len(prompt) > max_prompt_len:
            raise UserError(
                f"prompt {i} has {len(prompt)} tokens, more than rollout.max_prompt_len={max_prompt_len}; "
                "tokenise prompts with homerlhf.data.tokens.tokenize_prompts, which fits them"
            )


def generate_rollout(policy, prompts: Sequence[Sequence[int]], rollout: RolloutConfig,
                     seeds: Optional[Sequence[int]] = None) -> RolloutBatch:
    """Sample one response per prompt with the actor. ``policy``: a ``PolicyModel``.

    ``seeds``: one per prompt; each sample then draws from a generator of its own, so its response
    does not depend on the other prompts of the chunk (:mod:`homerlhf.models.sampling`). Without
    them sampling uses torch's global generator."""
    tokenizer = policy.tokenizer
    check_prompt_lengths(prompts, rollout.max_prompt_len)
    prompt_ids, prompt_mask = pad_sequences(prompts, tokenizer.pad_token_id, device=policy.device)
    policy.checkpoint_activations(False)
    config = build_generation_config(max_new_tokens=rollout.max_new_tokens, temperature=rollout.temperature,
                                     stop_ids=policy.stop_ids, pad_id=tokenizer.pad_token_id,
                                     prefill_chunk_size=rollout.prefill_columns(*prompt_ids.shape))
    recorder = BehaviourLogprobs(rollout.temperature)
    sampler = PerSampleSampler(seeds, rollout.temperature, policy.device) if seeds is not None else None
    response_ids = policy.generate(prompt_ids, prompt_mask, config, recorder=recorder, logits_processor=sampler,
                                   decoder=resolve_decoder(rollout.decoder, policy.device))
    response_mask, truncated = response_mask_and_truncated(response_ids, policy.stop_ids)
    # Generation pads finished rows with the pad id, which may be a stop token; the mask alone decides.
    response_ids = torch.where(response_mask.bool(), response_ids, tokenizer.pad_token_id)
    behaviour = torch.where(response_mask.bool(), recorder.taken(response_ids), 0.0)
    return RolloutBatch(prompt_ids, prompt_mask, response_ids, response_mask, truncated, behaviour)


def apply_truncation_penalty(scores: Tensor, batch: RolloutBatch, rollout: RolloutConfig) -> Tensor:
    """scores (B,) -> (B,) with truncated rows' scores replaced by the configured penalty."""
    return truncation_penalized_scores(scores, batch.truncated.to(scores.device), rollout.truncation_penalty)

"""What one PPO iteration learns from: ids, masks, log-probs, values, scores and advantages.

Tensors only, detached: no autograd graph survives the rollout. Every tensor is on one device, the
trainer's: building an experience that mixes devices, or giving it a field on another one, raises
at once, naming the fields (:mod:`homerlhf.ppo.devices` places what comes from the backends).
Chunks generated separately have different prompt and response widths; ``Experience.cat`` pads them
to a common shape (prompts on the left, responses on the right), and ``trimmed`` drops columns that
are padding in every row.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Iterator, Optional

import torch
from torch import Tensor

# Fields padded on the left (prompt block) and on the right (response block) when concatenating.
_PROMPT_FIELDS = ("prompt_ids", "prompt_mask")
_RESPONSE_FIELDS = (
    "response_ids", "response_mask", "old_logprobs", "ref_logprobs", "values", "rewards", "advantages", "returns", "kl",
    "behaviour_logprobs", "is_weights",
)


@dataclass
class Experience:
    prompt_ids: Tensor  # (B, P) long, left-padded
    prompt_mask: Tensor  # (B, P) long, 1 on prompt tokens
    response_ids: Tensor  # (B, T) long, right-padded
    response_mask: Tensor  # (B, T) long, 1 on response tokens up to and including EOS
    old_logprobs: Tensor  # (B, T) log pi_old(a_t | s_t): the trainer's own forward before the update
    ref_logprobs: Tensor  # (B, T) log pi_ref(a_t | s_t)
    values: Tensor  # (B, T) V_old(s_t) of the critic at rollout time
    scores: Tensor  # (B,) reward score after the truncation penalty (normalised apart: not stored)
    truncated: Tensor  # (B,) bool, hit max_new_tokens without EOS
    raw_scores: Optional[Tensor] = None  # (B,) reward-model score as returned
    rewards: Optional[Tensor] = None  # (B, T) KL-shaped per-token rewards
    kl: Optional[Tensor] = None  # (B, T) per-token KL estimate used in the rewards
    advantages: Optional[Tensor] = None  # (B, T) PPO's GAE advantages (whitened if configured)
    sequence_advantages: Optional[Tensor] = None  # (B,) GRPO / RLOO: one advantage per response
    returns: Optional[Tensor] = None  # (B, T) GAE returns, the critic's targets
    behaviour_logprobs: Optional[Tensor] = None  # (B, T) log-probs under the engine that sampled (mu)
    is_weights: Optional[Tensor] = None  # (B, T) truncated importance weights min(exp(old - behaviour), cap)
    policy_version: Optional[Tensor] = None  # (B,) long, updates applied to the actor that sampled each row

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Tensor) and value.requires_grad:
                setattr(self, f.name, value.detach())
        check_one_device(self)

    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(name, value)
        if isinstance(value, Tensor) and all(n in self.__dict__ for n in _FIELD_NAMES):  # built (or being)
            check_one_device(self)

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    @property
    def device(self) -> torch.device:
        """The device every tensor of this experience is on."""
        return self.prompt_ids.device

    @property
    def response_len(self) -> int:
        return self.response_ids.shape[1]

    def sequences(self) -> tuple[Tensor, Tensor]:
        """``(input_ids, attention_mask)``, each (B, P + T)."""
        return (
            torch.cat([self.prompt_ids, self.response_ids], dim=1),
            torch.cat([self.prompt_mask, self.response_mask], dim=1),
        )

    def select(self, index: Tensor) -> "Experience":
        """The rows at ``index`` (1-D long, on any device: a CPU permutation is moved here)."""
        index = index.to(self.device)
        return replace(self, **{
            f.name: getattr(self, f.name)[index] for f in fields(self) if getattr(self, f.name) is not None
        })

    def trimmed(self) -> "Experience":
        """Drop prompt columns that are padding in every row (left) and response columns likewise (right)."""
        return self._cut(*_kept_widths(self._extents()))

    def _extents(self) -> list[tuple[Optional[int], int]]:
        """Per row: its first prompt column that is not padding (None when none is) and one past its
        last response column that is not (0 when none is), read from the device in one transfer."""
        prompt, response = self.prompt_mask.bool(), self.response_mask.bool()
        width_p, width_t = prompt.shape[1], response.shape[1]
        first = torch.where(prompt.any(dim=1), prompt.long().argmax(dim=1), width_p)  # argmax: the first 1
        last = torch.where(response.any(dim=1), width_t - response.flip(1).long().argmax(dim=1), 0)
        return [(None if p == width_p else p, t) for p, t in torch.stack([first, last], dim=1).tolist()]

    def _cut(self, prompt_keep: int, response_keep: int) -> "Experience":
        """The prompt block from column ``prompt_keep`` on, the response block's first ``response_keep`` columns."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if f.name in _PROMPT_FIELDS:
                out[f.name] = value[:, prompt_keep:]
            elif f.name in _RESPONSE_FIELDS:
                out[f.name] = value[:, :response_keep]
        return replace(self, **out)

    def rows(self, start: int, stop: int) -> "Experience":
        """Rows ``start:stop`` (views, no copy)."""
        return replace(self, **{f.name: getattr(self, f.name)[start:stop] for f in fields(self)
                                if getattr(self, f.name) is not None})

    def to(self, device) -> "Experience":
        return replace(self, **{
            f.name: getattr(self, f.name).to(device) for f in fields(self) if getattr(self, f.name) is not None
        })

    @classmethod
    def cat(cls, parts: list["Experience"], pad_id: int) -> "Experience":
        """Concatenate along the batch, padding prompts on the left and responses on the right."""
        width_p = max(p.prompt_ids.shape[1] for p in parts)
        width_t = max(p.response_ids.shape[1] for p in parts)
        out = {}
        for f in fields(cls):
            values = [getattr(p, f.name) for p in parts]
            if any(v is None for v in values):
                out[f.name] = None
                continue
            padded = []
            for v in values:
                fill = pad_id if f.name in ("prompt_ids", "response_ids") else 0
                if f.name in _PROMPT_FIELDS:
                    v = torch.nn.functional.pad(v, (width_p - v.shape[1], 0), value=fill)
                elif f.name in _RESPONSE_FIELDS:
                    v = torch.nn.functional.pad(v, (0, width_t - v.shape[1]), value=fill)
                padded.append(v)
            out[f.name] = torch.cat(padded, dim=0)
        return cls(**out)

    def minibatches(self, size: int, generator: torch.Generator) -> Iterator["Experience"]:
        """Shuffled mini-batches of ``size`` rows (the last may be smaller), each trimmed of padding.
        The permutation is drawn on ``generator``'s device (the trainer's is a CPU one); the rows'
        widths are read from the device once for all of them."""
        order = torch.randperm(len(self), generator=generator, device=generator.device)
        extents, rows, picks = self._extents(), order.tolist(), order.to(self.device)  # read and sent once
        for start in range(0, len(self), size):
            widths = _kept_widths([extents[i] for i in rows[start : start + size]])
            yield self.select(picks[start : start + size])._cut(*widths)

    def split(self, size: int) -> Iterator["Experience"]:
        """Consecutive micro-batches of ``size`` rows, in order, each trimmed of padding. The widths of
        all of them are read from the device at once (one transfer, not a few per micro-batch)."""
        extents = self._extents()
        for start in range(0, len(self), size):
            stop = min(start + size, len(self))
            yield self.rows(start, stop)._cut(*_kept_widths(extents[start:stop]))


_FIELD_NAMES = tuple(f.name for f in fields(Experience))


@dataclass
class Rollout:
    """One iteration's batch as sampling and scoring leave it: what the advantages and update take."""

    exp: Experience  # scores, old log-probs, values and reference log-probs set; no rewards or advantages yet
    entropy: Tensor  # (B, T) the actor's per-token entropy at rollout
    components: dict[str, list] = field(default_factory=dict)  # per-reward scores of a weighted reward


def _kept_widths(extents: list[tuple[Optional[int], int]]) -> tuple[int, int]:
    """(first prompt column to keep, response columns to keep) of rows with these
    :meth:`Experience._extents`: the columns that are padding in every row go (every prompt column
    stays when no row has a prompt token; at least one response column stays)."""
    firsts = [p for p, _ in extents if p is not None]
    return (min(firsts) if firsts else 0), max([1] + [t for _, t in extents])


def check_one_device(exp: Experience) -> None:
    """Raise ``ValueError`` naming the fields of each device when ``exp``'s tensors are on more than one."""
    by_device: dict[str, list[str]] = {}
    for f in fields(exp):
        value = getattr(exp, f.name)
        if isinstance(value, Tensor):
            by_device.setdefault(str(value.device), []).append(f.name)
    if len(by_device) > 1:
        where = "; ".join(f"{', '.join(names)} on {device}" for device, names in by_device.items())
        raise ValueError(f"an Experience holds every tensor on one device, but it has {where}: place what the "
                         "backends and engines return with homerlhf.ppo.devices.to_trainer")

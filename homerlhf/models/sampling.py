"""Sampling where each row of a batch draws from a random stream of its own.

HF ``generate`` samples every row from the one global generator, so which tokens a sample gets
depends on the batch around it: generate 16 prompts at once or as 8 + 8 and the responses differ.
Then a rollout chunk halved after an out-of-memory error would redo the iteration with other samples.
:class:`PerSampleSampler` makes the draw of row ``i`` depend only on ``seeds[i]`` and the step: it
picks ``argmax(logits / T + Gumbel noise)`` (the Gumbel-max trick: an exact sample of
``softmax(logits / T)``) with noise from row ``i``'s own ``torch.Generator``, and hands HF a one-hot
distribution, whose multinomial draw is that token whatever the global generator holds.
"""

from __future__ import annotations

from typing import Sequence

import torch

# HF applies its temperature warper after custom processors: a one-hot row stays one-hot under it.
_NEG_INF = float("-inf")


class PerSampleSampler:
    """A ``LogitsProcessor``: row ``i`` sampled from ``softmax(scores[i] / temperature)`` with the
    generator seeded by ``seeds[i]``."""

    def __init__(self, seeds: Sequence[int], temperature: float, device):
        self.temperature = float(temperature)
        self.generators = [torch.Generator(device=device).manual_seed(int(seed)) for seed in seeds]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """scores: (B, V) next-token logits -> (B, V), 0 at each row's sampled token, -inf elsewhere."""
        if scores.shape[0] != len(self.generators):
            raise ValueError(f"{scores.shape[0]} rows but {len(self.generators)} seeds")
        uniform = torch.stack([torch.rand(scores.shape[1], generator=g, device=scores.device, dtype=torch.float32)
                               for g in self.generators])  # (B, V)
        gumbel = -torch.log(-torch.log(uniform.clamp_min(torch.finfo(torch.float32).tiny)))
        tokens = (scores.float() / self.temperature + gumbel).argmax(dim=-1)  # (B,)
        out = torch.full_like(scores, _NEG_INF)
        out.scatter_(1, tokens[:, None], 0.0)
        return out

"""The independent implementation the chunked log-probs are checked against."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def naive_logprobs():
    """``naive_logprobs(logits, targets)``: logits (B, T, V), targets (B, T) -> (B, T), all at once
    in fp32 (the one-piece computation the chunked one must equal)."""

    def compute(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)

    return compute

"""Chunked log-probs equal the one-piece computation, values and gradients."""

from __future__ import annotations

import pytest
import torch

from homerlhf.models.logprobs import chunked_logprobs, position_ids_from_mask, response_hidden


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 64])
def test_chunked_equals_naive_values_entropy_and_gradients(chunk_size, naive_logprobs):
    torch.manual_seed(0)
    B, T, H, V = 3, 7, 16, 50
    lm_head = torch.nn.Linear(H, V, bias=False)
    hidden = torch.randn(B, T, H, requires_grad=True)
    targets = torch.randint(0, V, (B, T))

    logprobs, entropy = chunked_logprobs(lm_head, hidden, targets, chunk_size)
    (logprobs * torch.arange(T)).sum().backward()
    grad_chunked = hidden.grad.clone()
    hidden.grad = None

    logits = lm_head(hidden)
    naive = naive_logprobs(logits, targets)
    (naive * torch.arange(T)).sum().backward()
    p = torch.softmax(logits, -1)
    naive_entropy = -(p * torch.log_softmax(logits, -1)).sum(-1)

    torch.testing.assert_close(logprobs, naive, atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, naive_entropy.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(grad_chunked, hidden.grad, atol=1e-5, rtol=0)
    assert not entropy.requires_grad  # a metric, never a loss term


def test_position_ids_skip_left_padding_and_response_hidden_alignment():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]])
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 3]]
    hidden = torch.arange(5.0).view(1, 5, 1)  # positions 0..4; prompt P=3, response T=2
    # Response token 0 (position 3) is predicted by position 2, token 1 by position 3.
    assert response_hidden(hidden, 2).flatten().tolist() == [2.0, 3.0]


def test_bad_chunk_size():
    with pytest.raises(ValueError):
        chunked_logprobs(torch.nn.Identity(), torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), 0)

"""Per-sample sampling: an exact draw from softmax(logits / T), decided by the row's own seed alone."""

from __future__ import annotations

import torch

from homerlhf.models.sampling import PerSampleSampler


def test_draws_follow_the_tempered_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    n = 20_000
    for temperature in (1.0, 0.5):
        sampler = PerSampleSampler(range(n), temperature, "cpu")
        out = sampler(None, logits.expand(n, 4))  # one step for n rows with n seeds
        assert torch.all((out == 0).sum(dim=1) == 1) and torch.all(torch.isinf(out).sum(dim=1) == 3)
        counts = (out == 0).sum(dim=0).float()
        want = torch.softmax(logits[0] / temperature, dim=0)
        sigma = torch.sqrt(want * (1 - want) / n)
        # p = (0.644, 0.237, 0.087, 0.032) at T=1: each within 4 standard errors
        assert torch.all((counts / n - want).abs() < 4 * sigma + 1e-9), (counts / n, want)


def test_a_row_draws_the_same_whatever_rows_share_its_batch():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 50, generator=gen)
    together = PerSampleSampler([11, 12, 13, 14, 15], 1.0, "cpu")
    alone = [PerSampleSampler([seed], 1.0, "cpu") for seed in (11, 12, 13, 14, 15)]
    for _step in range(3):  # the generators advance once per step, in each batch alike
        joint = together(None, logits).argmax(dim=1)
        single = torch.stack([s(None, logits[i : i + 1]).argmax(dim=1)[0] for i, s in enumerate(alone)])
        assert torch.equal(joint, single)

"""Per-sample sampling: an exact draw from softmax(logits / T), decided by the row's own seed alone, with
noise from one batch of kernels for all rows (``counter``) or a generator per row (``generator``)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from homerlhf.models.sampling import PerSampleSampler, counter_uniform, mix64_

NOISES = ["counter", "generator"]
M64, GOLDEN = 2**64 - 1, 0x9E3779B97F4A7C15


def _splitmix64_output(state: int) -> int:
    """SplitMix64's output function on Python ints (the independent implementation)."""
    z = state & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def test_the_counter_noise_is_splitmix64():
    # SplitMix64 seeded 0: its first output is 0xE220A8397B1DCDAF (the published reference value).
    assert _splitmix64_output(GOLDEN) == 0xE220A8397B1DCDAF
    assert mix64_(torch.tensor([GOLDEN - 2**64])).item() % 2**64 == 0xE220A8397B1DCDAF
    seeds = [0, 7, 2**63 - 1, 123_456_789_012]
    got = counter_uniform(torch.tensor(seeds), step=3, vocab=5)
    for i, seed in enumerate(seeds):
        key = _splitmix64_output(_splitmix64_output(seed) + 4 * GOLDEN)  # the step's key (step 3: + 4 G)
        for v in range(5):
            bits = _splitmix64_output(key + (v + 1) * GOLDEN) >> 41  # the top 23 bits
            assert got[i, v].item() == (bits + 0.5) / 2**23
    assert 0.0 < float(got.min()) and float(got.max()) < 1.0


@pytest.mark.parametrize("noise", NOISES)
def test_draws_follow_the_tempered_softmax(noise):
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    n = 20_000
    for temperature in (1.0, 0.5):
        sampler = PerSampleSampler(range(n), temperature, "cpu", noise)
        out = sampler(None, logits.expand(n, 4))  # one step for n rows with n seeds
        assert torch.all((out == 0).sum(dim=1) == 1) and torch.all(torch.isinf(out).sum(dim=1) == 3)
        counts = (out == 0).sum(dim=0).float()
        want = torch.softmax(logits[0] / temperature, dim=0)
        sigma = torch.sqrt(want * (1 - want) / n)
        # p = (0.644, 0.237, 0.087, 0.032) at T=1: each within 4 standard errors
        assert torch.all((counts / n - want).abs() < 4 * sigma + 1e-9), (counts / n, want)


@pytest.mark.parametrize("noise", NOISES)
def test_a_row_draws_the_same_whatever_rows_share_its_batch(noise):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 50, generator=gen)
    together = PerSampleSampler([11, 12, 13, 14, 15], 1.0, "cpu", noise)
    alone = [PerSampleSampler([seed], 1.0, "cpu", noise) for seed in (11, 12, 13, 14, 15)]
    for _step in range(3):  # the noise moves on once per step, in each batch alike
        joint = together(None, logits).argmax(dim=1)
        single = torch.stack([s.draw(logits[i : i + 1])[0] for i, s in enumerate(alone)])  # draw = the one-hot's token
        assert torch.equal(joint, single)


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _ops_per_draw(rows: int, noise: str) -> int:
    sampler = PerSampleSampler(range(rows), 1.0, "cpu", noise)
    scores = torch.zeros(rows, 64)
    with CountOps() as counter:
        sampler.draw(scores)
    return counter.ops


def test_the_counter_noise_launches_the_same_kernels_for_any_batch():
    """The ops of one draw (each a kernel launch on a GPU) do not grow with the rows for the counter
    noise; one ``torch.rand`` per row makes the generator noise's grow."""
    assert _ops_per_draw(2, "counter") == _ops_per_draw(32, "counter") < 50
    assert _ops_per_draw(32, "generator") - _ops_per_draw(2, "generator") >= 30


def test_the_default_noise_is_the_counter_on_cuda_only():
    assert PerSampleSampler([1], 1.0, "cpu").noise == "generator"
    assert PerSampleSampler([1], 1.0, "cpu", "counter").noise == "counter"
    if torch.cuda.is_available():
        assert PerSampleSampler([1], 1.0, "cuda").noise == "counter"

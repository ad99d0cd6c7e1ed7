"""The worker's chunked float32 log-softmax: exact against float64 torch, and bounded in memory."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import torch

from homerlhf.memory.host import LOGSOFTMAX_CHUNK_BYTES
from homerlhf.workers.logsoftmax import chunk_rows, token_logprobs

QWEN3_VOCAB = 151_669


def test_chunk_rows_by_hand():
    assert chunk_rows(QWEN3_VOCAB) == 27  # 16 MiB // (4 B x 151,669) = 16,777,216 // 606,676
    assert chunk_rows(1000, chunk_bytes=4000) == 1
    assert chunk_rows(10**9) == 1  # a row larger than the budget still makes progress


@pytest.mark.parametrize("temperature, chunk_bytes", [(1.0, LOGSOFTMAX_CHUNK_BYTES), (0.7, 3 * 4 * 500), (1.3, 1)])
def test_equals_float64_log_softmax(temperature, chunk_bytes):
    gen = np.random.default_rng(0)
    logits = (gen.standard_normal((37, 500)) * 8).astype(np.float32)  # large spread: exp would overflow unshifted
    logits[5, 7] = 90.0
    targets = gen.integers(0, 500, size=37)
    targets[5] = 7
    want = torch.log_softmax(torch.from_numpy(logits).double() / temperature, dim=-1)[torch.arange(37), torch.from_numpy(targets)]
    got = token_logprobs(logits, targets, temperature, chunk_bytes=chunk_bytes)
    assert got.dtype == np.float64 and got.shape == (37,)
    np.testing.assert_allclose(got, want.numpy(), rtol=0, atol=2e-5)
    assert got[5] == pytest.approx(0.0, abs=1e-6)  # one dominant logit: probability ~1


def test_1024_positions_of_a_150k_vocabulary_never_allocate_gigabytes():
    """llama.cpp's buffer is read in place: a (1024, 151,669) float32 block is 621 MB; a float64
    copy of it, as the worker once made, 1.24 GB. The chunked pass stays within one chunk."""
    row = np.random.default_rng(1).standard_normal(QWEN3_VOCAB).astype(np.float32)
    logits = np.broadcast_to(row, (1024, QWEN3_VOCAB))  # a read-only view: no 621 MB in the test itself
    targets = np.arange(1024) * 97 % QWEN3_VOCAB
    tracemalloc.start()  # numpy reports its allocations to tracemalloc
    try:
        got = token_logprobs(logits, targets)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < LOGSOFTMAX_CHUNK_BYTES + 2 * 1024**2, f"peak transient {peak / 1024**2:.1f} MiB"
    want = torch.log_softmax(torch.from_numpy(row).double(), dim=-1)[torch.from_numpy(targets)]
    np.testing.assert_allclose(got, want.numpy(), rtol=0, atol=2e-5)
